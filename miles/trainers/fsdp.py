"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the embedded trainer on several GPUs.

UNTESTED: CI and the dev machines have no multi-GPU host, so this path has never run. It is
kept deliberately small: each decoder layer is one FSDP unit, the root holds the embeddings
and LM head; parameters are gathered in the compute dtype and gradients reduced in float32.
Each rank trains on its own groups; FSDP averages gradients over ranks, so the effective
loss is the mean over ranks of each rank's aggregated loss.
"""

from __future__ import annotations

import torch
from torch import nn


def distributed_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def maybe_fully_shard(model: nn.Module, fsdp: bool | None, compute_dtype: torch.dtype) -> bool:
    """Shard ``model`` in place when asked (or, for ``fsdp=None``, when torch.distributed
    runs with more than one rank). Returns whether it did."""
    world = distributed_world_size()
    use = world > 1 if fsdp is None else fsdp
    if not use:
        return False
    if world <= 1:
        raise ValueError("TrainerConfig.fsdp=True needs torch.distributed initialized with more than one rank")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # untested path

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return True
