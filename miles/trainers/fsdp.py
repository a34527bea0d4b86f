"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the embedded trainer on several GPUs.

It is kept deliberately small: each decoder layer is one FSDP unit, the root holds the
embeddings and LM head; parameters are gathered in the compute dtype and gradients reduced in
float32. Each rank trains on its own groups; FSDP averages gradients over ranks, so the
effective loss is the mean over ranks of each rank's aggregated loss.

Tested on two CPU ranks over gloo (tests/unit/trainers/test_fsdp.py): two training steps match
one unsharded trainer on both ranks' groups (the pre-clip gradient norm to 1e-5, the weights to
AdamW's rounding), and every rank exports the full weights. Not yet run on several GPUs (NCCL):
no multi-GPU machine has been lent since this was written.
"""

from __future__ import annotations

import torch
from torch import nn


def distributed_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def wants_fsdp(fsdp: bool | None) -> bool:
    """Whether the trainer shards: as asked, or (``fsdp=None``) when torch.distributed runs
    with more than one rank."""
    return distributed_world_size() > 1 if fsdp is None else fsdp


def maybe_fully_shard(model: nn.Module, fsdp: bool | None, compute_dtype: torch.dtype) -> bool:
    """Shard ``model`` in place when asked (or, for ``fsdp=None``, when torch.distributed
    runs with more than one rank). Returns whether it did."""
    if not wants_fsdp(fsdp):
        return False
    if distributed_world_size() <= 1:
        raise ValueError("TrainerConfig.fsdp=True needs torch.distributed initialized with more than one rank")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return True
