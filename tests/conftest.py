"""Session-wide test setup.

On a machine without CUDA, triton (where installed) runs its kernels in its CPU interpreter,
so the Triton decode-attention tests can check the kernel there. It must be set before
``miles.kernels`` is first imported: ``triton.jit`` reads it when a kernel is defined."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
