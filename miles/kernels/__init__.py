"""Hand-written GPU kernels (Triton) for the embedded engine; each module says what torch's
own ops could not do and falls back cleanly where triton is missing."""
