"""Test-only emulation: run megatron-core's CUDA code paths on the CPU.

megatron-core places tensors on ``torch.cuda.current_device()`` or on the literal "cuda"
(rotary tables, DDP buffers, optimizer scale, schedule token counters), uses CUDA streams,
events and RNG state, and asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``. Its
arithmetic is plain torch. ``install`` redirects exactly those things to the CPU (and
torch.distributed to gloo), so the unit tests run the real Megatron model, DDP, optimizer and
schedule — and the MegatronTrainer on top — on a machine without a GPU.

Two levels: ``install(full=False)`` only points ``current_device`` at the CPU (enough for the
model's forward and backward; used in-process through ``monkeypatch``); ``install(full=True)``
patches torch factories and CUDA helpers process-wide, so it is only called inside spawned
child processes (``spawn``) that exit afterwards. Nothing here is used outside tests; real
numerics on CUDA are covered by ``tests/gpu/test_megatron_gpu.py``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

CPU = torch.device("cpu")
FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like",
             "full_like", "randn", "rand", "randint", "as_tensor")


def _is_cuda(x: Any) -> bool:
    return (isinstance(x, (str, torch.device)) and str(x).startswith("cuda")) or (
        isinstance(x, int) and not isinstance(x, bool))


def _fix(kw: dict[str, Any]) -> dict[str, Any]:
    if kw.get("device") is not None and _is_cuda(kw["device"]):
        kw["device"] = CPU
    return kw


class _Stream:
    def __init__(self, *a: Any, **k: Any) -> None: ...
    def wait_event(self, *a: Any) -> None: ...
    def wait_stream(self, *a: Any) -> None: ...
    def synchronize(self) -> None: ...
    def record_event(self, *a: Any, **k: Any) -> _Event: return _Event()
    def __enter__(self) -> _Stream: return self
    def __exit__(self, *a: Any) -> bool: return False


class _Event:
    def __init__(self, *a: Any, **k: Any) -> None: ...
    def record(self, *a: Any) -> None: ...
    def wait(self, *a: Any) -> None: ...
    def synchronize(self) -> None: ...


def install(full: bool = False) -> None:
    torch.cuda.current_device = lambda: CPU
    if not full:
        return
    for name in FACTORIES:
        orig = getattr(torch, name)
        setattr(torch, name, lambda *a, _o=orig, **kw: _o(*a, **_fix(kw)))
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.get_rng_state_all = lambda: []
    cuda.set_rng_state_all = lambda s: None
    cuda.get_rng_state = cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = cuda.random.set_rng_state = lambda *a, **k: None
    cuda.manual_seed = lambda *a, **k: None
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _Stream()
    cuda.Stream, cuda.Event = _Stream, _Event
    cuda.stream = lambda s: _Stream()
    tensor_to, module_to, tensor_type = torch.Tensor.to, torch.nn.Module.to, torch.Tensor.type
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.to = lambda self, *a, **kw: tensor_to(
        self, *(CPU if i == 0 and _is_cuda(x) else x for i, x in enumerate(a)), **_fix(kw))
    torch.nn.Module.to = lambda self, *a, **kw: module_to(self, *(CPU if _is_cuda(x) else x for x in a), **_fix(kw))

    def cuda_type(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        if a or k:
            return tensor_type(self, *a, **k)
        return tensor_type(self).replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type
    init = dist.init_process_group
    dist.init_process_group = lambda backend=None, *a, **k: init("gloo", *a, **k)
    a2a = dist.all_to_all_single

    def all_to_all_single(output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None,
                          *a: Any, **k: Any) -> Any:
        def ints(s: Any) -> Any:  # megatron passes numpy arrays, which torch's binding refuses
            return None if s is None else [int(x) for x in s]

        return a2a(output, input, ints(output_split_sizes), ints(input_split_sizes), *a, **k)

    dist.all_to_all_single = all_to_all_single
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._set_cuda_rng_state = lambda *a, **k: None
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()


def rank_env(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def _child(target: Any, rank: int, world: int, port: int, args: tuple, queue: Any) -> None:
    import traceback

    rank_env(rank, world, port)
    torch.set_num_threads(1)
    try:
        queue.put((rank, target(rank, *args), None))
    except BaseException:  # report instead of hanging the parent until its timeout
        queue.put((rank, None, traceback.format_exc()))


def run_ranks(target: Any, world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``target(rank, *args)`` in ``world`` spawned processes joined by a gloo process
    group; return the results by rank, or raise with the first child's traceback."""
    import torch.multiprocessing as mp

    from miles.utils.net import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(target, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, value, error = queue.get(timeout=timeout)
            if error is not None:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
