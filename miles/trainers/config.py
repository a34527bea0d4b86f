"""``TrainerConfig``: the embedded trainer's flags (optimizer, LR schedule, batching,
precision, non-finite handling), and the LR schedule as a pure function of the step.

Field names are the CLI flag names with '-' → '_'. The algorithm's flags live in
``miles.algorithms.AlgorithmConfig``; the trainer takes both.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

DecayStyle = Literal["constant", "cosine", "linear"]
Dtype = Literal["auto", "float32", "bfloat16"]


class TrainerConfigError(ValueError):
    """A TrainerConfig field has a bad value; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"TrainerConfig.{field}: {message}")
        self.field = field


class TrainerConfig(msgspec.Struct, kw_only=True):
    """Optimizer, schedule, batching and precision of the embedded trainer."""

    # --- optimizer (AdamW; no weight decay on 1-D params: norms and biases) ---------------
    lr: float = 1e-6  # AdamW learning rate (peak, after warmup)
    min_lr: float = 0.0
    lr_warmup_steps: int = 0  # linear warmup steps from 0 to --lr
    lr_decay_style: DecayStyle = "constant"  # the learning rate after warmup: constant, or a decay towards --min-lr
    lr_decay_steps: int | None = None  # steps after warmup to decay over (cosine/linear)
    weight_decay: float = 0.0  # AdamW weight decay (not on norms and biases)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # max global grad norm; 0 disables clipping (norm still logged)

    # --- batching ------------------------------------------------------------------------
    # Limits of one forward/backward: most sequences, most padded tokens (rows × longest).
    # Within them the planner cuts where padding + a per-micro-batch cost (per device:
    # batching.micro_batch_cost) is least (batching.plan_micro_batches), so long-tailed
    # batches are not padded to their longest.
    micro_batch_size: int | None = None
    max_tokens_per_micro_batch: int | None = None  # most padded tokens (rows × longest) in one micro-batch
    num_steps_per_rollout: int = 1  # optimizer steps per train_step (PPO mini-batches)

    # --- numerics and placement ----------------------------------------------------------
    # compute dtype ("auto": float32 on the CPU, bfloat16 on CUDA, as the engine's --dtype);
    # parameters and AdamW state stay float32
    dtype: Dtype = "auto"
    device: str = "cpu"
    seed: int = 0
    rollout_temperature: float = 1.0  # logits are divided by it, as the engine samples
    # torch.compile each decoder layer (dynamic shapes: one set of graphs for every micro-batch
    # shape; the attention call stays eager). Shares --compile with the engine. None = auto:
    # on for a dense model on one GPU (about twice the eager step's speed on RL's long-tailed
    # batches; the first step compiles); off on the CPU (it needs a C++ compiler and its
    # compile time outweighs its small gain there), for MoE (data-dependent expert dispatch) and under FSDP2, which were
    # not measured compiled.
    compile: bool | None = None
    # When the compiled layers' warm-up runs (trainers.compile_cache): "background" in a child
    # process that fills torch's on-disk compile caches while the first steps run eagerly, the
    # layers compiled between steps once it is done (from the caches: seconds); "inline" in
    # the trainer's construction, before the first step. "auto": background on CUDA; inline
    # on the CPU, where the child's compile would take the cores the eager steps need.
    compile_warmup: Literal["auto", "background", "inline"] = "auto"
    gradient_checkpointing: bool = False  # recompute decoder layers in backward
    fsdp: bool | None = None  # None → FSDP2 when torch.distributed has > 1 rank

    offload_train: bool = False  # AdamW state in pinned host memory between steps (colocated; miles.trainers.offload)

    # --- LoRA (miles.trainers.lora): adapters over frozen base weights; 0 trains every weight
    lora_rank: int = 0  # LoRA rank r (0: full-parameter training)
    lora_alpha: float = 16.0  # LoRA alpha: the adapters' update is scaled by alpha / rank
    lora_dropout: float = 0.0  # dropout on the adapters' input while training
    lora_target_modules: list[str] = msgspec.field(default_factory=lambda: ["all-linear"])  # PEFT names (q_proj ... down_proj) or all-linear

    # --- robustness ----------------------------------------------------------------------
    skip_nonfinite_steps: bool = True
    max_consecutive_nonfinite: int = 3  # raise after this many non-finite steps in a row
    # train/rollout_logprob_abs_diff_max is reported every step; "strict" stops the run when
    # it is non-zero (the engine's log-prob is not bitwise the trainer's)
    true_on_policy_check: Literal["report", "strict"] = "report"  # strict: stop the run if a rollout log-prob differs from the trainer's
    zero_advantage_rows: Literal["forward", "skip"] = "skip"  # rows whose gradient is exactly 0 (every advantage 0, no entropy bonus or KL loss; eager single-rank trainer): skip gives them no forward (the same update for less compute; per-token diagnostics cover the rows that train); forward runs them without autograd, so the diagnostics (ratios, clip fraction, mismatch KL, entropy) cover every row

    # --- MoE / rewards -------------------------------------------------------------------
    use_rollout_routing_replay: bool = False  # MoE: the trainer routes each token to the experts the engine chose (R3)
    reward_key: str | None = None  # which entry of a dict reward to train on (None → sum)

    def __post_init__(self) -> None:
        validate(self)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise TrainerConfigError(field, message)


def _num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate(cfg: TrainerConfig) -> None:
    """Raise TrainerConfigError naming the first bad field."""
    _check(cfg.lr_decay_style in ("constant", "cosine", "linear"), "lr_decay_style",
           f"{cfg.lr_decay_style!r} is not one of ['constant', 'cosine', 'linear']")
    _check(cfg.dtype in ("auto", "float32", "bfloat16"), "dtype",
           f"{cfg.dtype!r} is not one of ['auto', 'float32', 'bfloat16']")
    _check(_num(cfg.lr) and cfg.lr >= 0, "lr", f"must be >= 0, got {cfg.lr!r}")
    _check(_num(cfg.min_lr) and 0 <= cfg.min_lr <= cfg.lr, "min_lr", f"must be in [0, lr], got {cfg.min_lr!r}")
    for field in ("lr_warmup_steps",):
        v = getattr(cfg, field)
        _check(isinstance(v, int) and v >= 0, field, f"must be an int >= 0, got {v!r}")
    if cfg.lr_decay_style != "constant":
        _check(isinstance(cfg.lr_decay_steps, int) and cfg.lr_decay_steps > 0, "lr_decay_steps",
               f"{cfg.lr_decay_style} decay needs lr_decay_steps > 0, got {cfg.lr_decay_steps!r}")
    _check(_num(cfg.weight_decay) and cfg.weight_decay >= 0, "weight_decay", f"must be >= 0, got {cfg.weight_decay!r}")
    for field in ("adam_beta1", "adam_beta2"):
        v = getattr(cfg, field)
        _check(_num(v) and 0 <= v < 1, field, f"must be in [0, 1), got {v!r}")
    _check(_num(cfg.adam_eps) and cfg.adam_eps > 0, "adam_eps", f"must be > 0, got {cfg.adam_eps!r}")
    _check(_num(cfg.clip_grad) and cfg.clip_grad >= 0, "clip_grad", f"must be >= 0, got {cfg.clip_grad!r}")
    for field in ("micro_batch_size", "max_tokens_per_micro_batch"):
        v = getattr(cfg, field)
        _check(v is None or (isinstance(v, int) and v > 0), field, f"must be a positive int or None, got {v!r}")
    for field in ("num_steps_per_rollout", "max_consecutive_nonfinite"):
        v = getattr(cfg, field)
        _check(isinstance(v, int) and v >= 1, field, f"must be an int >= 1, got {v!r}")
    _check(_num(cfg.rollout_temperature) and cfg.rollout_temperature > 0, "rollout_temperature",
           f"must be > 0, got {cfg.rollout_temperature!r}")
    _check(isinstance(cfg.lora_rank, int) and cfg.lora_rank >= 0, "lora_rank",
           f"must be an int >= 0, got {cfg.lora_rank!r}")
    _check(_num(cfg.lora_alpha) and cfg.lora_alpha > 0, "lora_alpha", f"must be > 0, got {cfg.lora_alpha!r}")
    _check(_num(cfg.lora_dropout) and 0 <= cfg.lora_dropout < 1, "lora_dropout",
           f"must be in [0, 1), got {cfg.lora_dropout!r}")
    _check(bool(cfg.lora_target_modules), "lora_target_modules", "must name at least one module (or all-linear)")
    _check(cfg.device == "cpu" or cfg.device.startswith("cuda"), "device",
           f"must be 'cpu' or 'cuda[:i]', got {cfg.device!r}")


def lr_at(step: int, cfg: TrainerConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup to ``lr`` over
    ``lr_warmup_steps`` (the first step already gets lr/warmup), then constant, or cosine /
    linear decay to ``min_lr`` over ``lr_decay_steps``, then ``min_lr``."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    assert cfg.lr_decay_steps is not None
    progress = min(1.0, (step - cfg.lr_warmup_steps) / cfg.lr_decay_steps)
    if cfg.lr_decay_style == "cosine":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr - (cfg.lr - cfg.min_lr) * progress
