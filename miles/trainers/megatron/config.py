"""``MegatronConfig``: the flags of the Megatron-core trainer backend (``--train-backend megatron``).

Field names are Megatron-LM's / slime's flag names with '-' → '_'
(``--tensor-model-parallel-size`` ↔ ``tensor_model_parallel_size``), so a slime user's
parallelism flags carry over. Optimizer, LR schedule, batching, dtype and seed come from
``TrainerConfig`` (the embedded trainer's flags, shared by both backends); the algorithm
from ``AlgorithmConfig``. This module imports no megatron-core: the config layer loads it
on machines without the extra.

Data parallelism is what is left of the world: ``dp = world / (tp · pp · cp)``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

TransformerImpl = Literal["auto", "local", "transformer_engine"]
CoreAttention = Literal["sdpa", "megatron"]
Recompute = Literal["full", "selective"]
Dispatcher = Literal["allgather", "alltoall"]


class MegatronConfigError(ValueError):
    """A MegatronConfig field (or its combination with the model) is invalid; names the flag."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"--{field.replace('_', '-')}: {message}")
        self.field = field


class MegatronConfig(msgspec.Struct, kw_only=True):
    """Parallelism, layer implementation and memory options of the Megatron-core trainer."""

    # --- parallelism (Megatron-LM names) --------------------------------------------------
    tensor_model_parallel_size: int = 1  # ranks that split each layer's weights (TP)
    pipeline_model_parallel_size: int = 1  # ranks that split the layers into stages (PP)
    context_parallel_size: int = 1  # needs transformer_engine attention
    expert_model_parallel_size: int = 1  # ranks that split the MoE experts (EP)
    expert_tensor_parallel_size: int | None = None  # None → same as tensor_model_parallel_size
    sequence_parallel: bool = False  # needs tensor_model_parallel_size > 1

    # --- layers -----------------------------------------------------------------------------
    # auto: the Transformer Engine layer spec when transformer_engine imports, else local.
    transformer_impl: TransformerImpl = "auto"
    # Core attention of the *local* spec: torch SDPA (flash / memory-efficient kernels, causal,
    # GQA without repeating K/V) or Megatron's DotProductAttention (materialises [b, h, s, s]).
    local_core_attention: CoreAttention = "sdpa"
    make_vocab_size_divisible_by: int = 128  # vocab padded to a multiple of this × TP

    # --- activation recomputation (Megatron names; TrainerConfig.gradient_checkpointing=True
    # means recompute_granularity="full" when this is unset) ---------------------------------
    recompute_granularity: Recompute | None = None
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: int = 1

    # --- MoE --------------------------------------------------------------------------------
    moe_token_dispatcher_type: Dispatcher = "alltoall"
    moe_router_dtype: Literal["fp32", "fp64"] | None = "fp32"
    moe_aux_loss_coeff: float = 0.0  # RL default 0 (slime); >0 adds the load-balancing loss

    # --- optimizer sharding -----------------------------------------------------------------
    # Shard optimizer state over data-parallel ranks (ZeRO-1). The trainer's state_dict()
    # does not cover the sharded layout yet (it raises); keep False to checkpoint.
    use_distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        validate(self)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size


def _positive(cfg: MegatronConfig, field: str) -> None:
    v = getattr(cfg, field)
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise MegatronConfigError(field, f"must be an int >= 1, got {v!r}")


def validate(cfg: MegatronConfig) -> None:
    """Checks that need no model and no world size; ``check_layout`` does the rest."""
    for field in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                  "expert_model_parallel_size", "make_vocab_size_divisible_by", "recompute_num_layers"):
        _positive(cfg, field)
    if cfg.expert_tensor_parallel_size is not None:
        _positive(cfg, "expert_tensor_parallel_size")
    if cfg.sequence_parallel and cfg.tensor_model_parallel_size == 1:
        raise MegatronConfigError("sequence_parallel", "needs --tensor-model-parallel-size > 1")
    if cfg.moe_aux_loss_coeff < 0:
        raise MegatronConfigError("moe_aux_loss_coeff", f"must be >= 0, got {cfg.moe_aux_loss_coeff!r}")
    for field, choices in (("transformer_impl", ("auto", "local", "transformer_engine")),
                           ("local_core_attention", ("sdpa", "megatron")),
                           ("moe_token_dispatcher_type", ("allgather", "alltoall")),
                           ("recompute_method", ("uniform", "block"))):
        if getattr(cfg, field) not in choices:
            raise MegatronConfigError(field, f"{getattr(cfg, field)!r} is not one of {list(choices)}")
    if cfg.recompute_granularity not in (None, "full", "selective"):
        raise MegatronConfigError("recompute_granularity", f"{cfg.recompute_granularity!r} is not "
                                  "one of [None, 'full', 'selective']")


def data_parallel_size(cfg: MegatronConfig, world_size: int) -> int:
    """``world / (tp · pp · cp)``; raises if the world does not divide, or if EP × ETP does
    not divide the ranks of one pipeline stage (Megatron's rule for the expert groups)."""
    mp = cfg.model_parallel_size
    if world_size % mp:
        raise MegatronConfigError(
            "tensor_model_parallel_size",
            f"world size {world_size} is not a multiple of tp·pp·cp = {mp} "
            f"({cfg.tensor_model_parallel_size}·{cfg.pipeline_model_parallel_size}·{cfg.context_parallel_size})")
    dp = world_size // mp
    stage = world_size // cfg.pipeline_model_parallel_size
    if stage % (cfg.expert_model_parallel_size * cfg.etp):
        raise MegatronConfigError(
            "expert_model_parallel_size",
            f"expert_model_parallel_size × expert_tensor_parallel_size = "
            f"{cfg.expert_model_parallel_size * cfg.etp} must divide the {stage} ranks of a pipeline stage")
    return dp
