"""Constants the kernels share with the torch code they reproduce bitwise.

The seeded token draw hashes (row key, vocabulary index) with splitmix64's finaliser and maps
the top ``UNIFORM_BITS`` bits to a uniform in (0, 1); ``miles.engines.sampling`` (torch) and
``miles.kernels.sampling`` / ``cpu_decode`` (Triton, C) read these numbers from here, so the
kernels import nothing from the engine.
"""

GREEDY_EPS = 1e-6  # a temperature at or below this samples greedily (argmax)
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment (unsigned)
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's multipliers (unsigned)

# u = (k + 0.5) / 2^23 from the hash's top 23 bits k: exact in float32 and strictly inside
# (0, 1). With 24 bits, k + 0.5 needs 25 bits of mantissa: float32 rounds it to an even
# integer, and k = 2^24 - 1 gives u = 1.0, so -log(-log u) = +inf and that vocabulary entry
# wins the draw whatever its logit.
UNIFORM_BITS = 23
UNIFORM_SHIFT = 64 - UNIFORM_BITS
