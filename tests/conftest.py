"""Session-wide test setup.

On a machine without CUDA, triton (where installed) runs its kernels in its CPU interpreter,
so the Triton decode-attention tests can check the kernel there. It must be set before
``miles.kernels`` is first imported: ``triton.jit`` reads it when a kernel is defined."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test starts with the process's intra-op thread count: torch's setting is process-wide
    (a CPU trainer's pool helpers set one thread from their own thread), and a later test's
    round-off, so its learning curve or an exactness check, follows the thread count."""
    yield
    if torch.get_num_threads() != _THREADS:
        torch.set_num_threads(_THREADS)
