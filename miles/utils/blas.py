"""The BLAS torch links on the CPU: its symbols, and how many threads small GEMMs get.

Why this exists: the embedded engine runs its model on a stepping thread (miles.engines.embedded),
so its OpenMP team is a second one beside the main thread's. With more OpenMP threads than
cores, libgomp stops spinning between parallel regions and wakes its workers through the kernel
for each one, tens of microseconds a GEMM. On a decode step of a small model that costs more
than a second thread saves: on 2 cores, in a non-main thread, a small GEMM runs several times
faster on one thread than on two, and break-even comes near 2^24 multiply-adds
(``benchmarks/blas_choice.py``); a tiny model's engine decodes faster with small GEMMs on one
thread (``benchmarks/engine.py``). So GEMMs below ``ONE_THREAD_GEMM`` run on one BLAS thread;
larger ones keep torch's count. Only MKL has a per-thread count (``MKL_Set_Num_Threads_Local``); with
another BLAS everything stays as torch sets it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from pathlib import Path

import torch

ONE_THREAD_GEMM = 1 << 24  # multiply-adds below which a GEMM runs on one BLAS thread


@functools.cache
def torch_cpu_library() -> ctypes.CDLL | None:
    """torch's CPU library (which links its BLAS), or None."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        if (lib_dir / name).is_file():
            try:
                return ctypes.CDLL(str(lib_dir / name))
            except OSError:
                return None
    return None


def symbol(name: str) -> int:
    """Address of ``name`` in torch's CPU library, or 0."""
    lib = torch_cpu_library()
    fn = getattr(lib, name, None) if lib is not None else None
    return (ctypes.cast(fn, ctypes.c_void_p).value or 0) if fn is not None else 0


def set_threads_address() -> int:
    """Address of MKL's ``MKL_Set_Num_Threads_Local`` (the calling thread's BLAS threads; 0
    means torch's global count; it returns the previous value), or 0 where the BLAS is not MKL.
    (The lower-case name is MKL's Fortran binding, which takes a pointer.)"""
    return symbol("MKL_Set_Num_Threads_Local")


@functools.cache
def _set_threads() -> ctypes._CFuncPtr | None:
    address = set_threads_address()
    if not address:
        return None
    return ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(address)


@contextlib.contextmanager
def blas_threads_for(multiply_adds: int) -> Iterator[None]:
    """Run the block's GEMMs on one BLAS thread of this thread when its largest GEMM has fewer
    than ``ONE_THREAD_GEMM`` multiply-adds; restores the thread's previous count after."""
    fn = _set_threads() if multiply_adds < ONE_THREAD_GEMM else None
    if fn is None:
        yield
        return
    before = fn(1)
    try:
        yield
    finally:
        fn(before)
