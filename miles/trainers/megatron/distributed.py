"""Process groups for the Megatron trainer: start torch.distributed and Megatron's parallel
state, describe this rank's place (``Layout``), and the two small autograd collectives the
log-prob code needs.

Every rank runs the same program (SPMD). A single process needs no launcher (world size 1,
address 127.0.0.1); several ranks come from ``torchrun`` (``RANK`` / ``WORLD_SIZE`` /
``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` in the environment) or from
``miles.trainers.megatron.launch.RayRankGroup``, which sets the same variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.trainers.megatron.config import MegatronConfig, MegatronConfigError, data_parallel_size
from miles.utils.net import free_port


def init_process_group(device: str) -> None:
    """Start torch.distributed from the environment (torchrun's variables), or as a world of
    one. NCCL on CUDA, gloo on the CPU. A started process group is left as it is; a world of
    one whose port turns out to be taken tries another."""
    if dist.is_initialized():
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world > 1:
            raise RuntimeError("WORLD_SIZE > 1 but MASTER_PORT is not set (launch with torchrun)")
        os.environ["MASTER_PORT"] = str(free_port())
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    for attempt in range(3):
        try:
            dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
            return
        except dist.DistNetworkError:
            # the port was taken between its choice and the store's bind; a world of one owns
            # its store, so another port will do (ranks of a larger world all know this one)
            if world > 1 or attempt == 2:
                raise
            os.environ["MASTER_PORT"] = str(free_port())


@dataclass(frozen=True)
class Layout:
    """This rank's coordinates in the parallel grid."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    dp: int = 1
    dp_rank: int = 0
    sequence_parallel: bool = False

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_parallel(cfg: MegatronConfig, *, device: str, seed: int) -> Layout:
    """torch.distributed + ``parallel_state.initialize_model_parallel`` + Megatron's
    model-parallel RNG. Reuses parallel state that already has the same sizes."""
    from megatron.core import parallel_state as ps

    init_process_group(device)
    data_parallel_size(cfg, dist.get_world_size())  # clear error before Megatron asserts
    sizes = dict(tensor_model_parallel_size=cfg.tensor_model_parallel_size,
                 pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
                 context_parallel_size=cfg.context_parallel_size,
                 expert_model_parallel_size=cfg.expert_model_parallel_size,
                 expert_tensor_parallel_size=cfg.etp)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                ps.get_expert_tensor_parallel_world_size())
        if have != tuple(sizes.values()):
            raise MegatronConfigError("tensor_model_parallel_size",
                                      f"Megatron parallel state already exists with (tp, pp, cp, ep, etp) = "
                                      f"{have}, not {tuple(sizes.values())}")
    else:
        ps.initialize_model_parallel(**sizes)
    if device.startswith("cuda"):
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout(cfg.sequence_parallel)


def current_layout(sequence_parallel: bool = False) -> Layout:
    from megatron.core import parallel_state as ps

    return Layout(
        tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
        dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
        sequence_parallel=sequence_parallel,
    )


def groups() -> dict[str, Any]:
    """Megatron's process groups by short name."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
            "cp": ps.get_context_parallel_group(), "ep": ps.get_expert_model_parallel_group(),
            "etp": ps.get_expert_tensor_parallel_group(), "dp": ps.get_data_parallel_group()}


def group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group`` in forward; identity in backward. For a quantity every rank of the
    group then uses identically (the gradient already arrives on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    """Identity in forward; sum of the gradients over ``group`` in backward. For an input
    that every rank of the group uses for a different slice of the work (a vocab shard)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: Tensor, group: Any) -> Tensor:
    return x if group_size(group) == 1 else _AllReduceSum.apply(x, group)


def copy_to_group(x: Tensor, group: Any) -> Tensor:
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)
