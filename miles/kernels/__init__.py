"""Hand-written kernels for the embedded engine, each where torch's own ops fall short:
``decode_attention`` (Triton, CUDA: length-aware decode attention), ``sampling`` (Triton: a
decode step's draw in one pass over its logits), ``gate_up`` (Triton: a decode MLP's gate/up
GEMM and SiLU·up in one launch) and ``cpu_decode`` (C: a CPU decode step in one call, past
torch's per-op dispatch). Each falls back cleanly, to torch ops, where it cannot run (no
triton, no C compiler, a probe launch that disagrees with torch)."""
