"""Hand-written kernels for the embedded engine, each where torch's own ops fall short:
``decode_attention`` (Triton, CUDA: length-aware decode attention) and ``cpu_decode`` (C: a
CPU decode step in one call, past torch's per-op dispatch). Each falls back cleanly, to torch
ops, where it cannot run (no triton, no C compiler)."""
