"""miles.utils.blas: small GEMMs on one BLAS thread of the calling thread, larger ones on
torch's count, the thread's own count restored after; the runner's CPU steps use it."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from miles.engines import EngineConfig
from miles.engines.runner import ModelRunner
from miles.utils import blas

from .engines.helpers import make_model


def _get_max_threads() -> ctypes._CFuncPtr:
    if not blas.set_threads_address():
        pytest.skip("torch's BLAS is not MKL: no per-thread count to set")
    return ctypes.CFUNCTYPE(ctypes.c_int)(blas.symbol("MKL_Get_Max_Threads"))


@pytest.fixture
def two_threads() -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_a_small_block_runs_on_one_thread_and_the_count_comes_back(two_threads: None) -> None:
    get = _get_max_threads()
    assert get() == 2
    with blas.blas_threads_for(blas.ONE_THREAD_GEMM - 1):
        assert get() == 1
        with blas.blas_threads_for(10):  # nested: the inner restore gives back the outer's 1
            assert get() == 1
        assert get() == 1
    assert get() == 2
    with blas.blas_threads_for(blas.ONE_THREAD_GEMM):
        assert get() == 2
    with pytest.raises(RuntimeError), blas.blas_threads_for(1):
        raise RuntimeError("a failing step")
    assert get() == 2


def test_the_count_is_the_calling_threads_own(two_threads: None) -> None:
    get = _get_max_threads()
    seen: list[int] = []

    def other() -> None:
        seen.append(get())

    with blas.blas_threads_for(1):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert get() == 1
    assert seen == [2]


@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "torch-ops"])
def test_decode_steps_leave_the_threads_count_as_they_found_it(kernel: bool, two_threads: None) -> None:
    """The C kernel switches per GEMM and the torch path per step; both restore. The step's
    result is the same as with torch's count (to float32 round-off: a BLAS may split a GEMM's
    sums differently with more threads)."""
    get = _get_max_threads()
    model = make_model(seed=2).requires_grad_(False)
    model.fuse_projections()
    runner = ModelRunner(model, EngineConfig(max_batch_size=4, max_seq_len=64, cpu_decode_kernel=kernel))
    assert (runner.cpu_kernel is not None) == kernel
    runner.prefill([0, 1, 2, 3], [[5, 6, 7], [8] * 9, [9, 10], [11] * 20], logits=False)
    k, v = runner.cache.k.clone(), runner.cache.v.clone()
    small = runner.decode([1, 2, 3, 4], [3, 9, 2, 20])
    assert get() == 2
    runner.cache.k.copy_(k)
    runner.cache.v.copy_(v)
    runner.gemm_width = blas.ONE_THREAD_GEMM  # every step "large": torch's count
    if runner.cpu_kernel is not None:
        runner.cpu_kernel.set_threads = None
    wide = runner.decode([1, 2, 3, 4], [3, 9, 2, 20])
    torch.testing.assert_close(small.logits, wide.logits, atol=2e-5, rtol=1e-5)
