"""The engine's memory plan: how many KV-cache slots fit beside weights, activations, the
colocated trainer and a margin, decided once at start and printed.

    budget   = total · engine_mem_fraction − in use (weights, and a colocated trainer's
               resident state) − trainer peak still to come − activations − margin
    slots    = min(max_batch_size, budget // (kv bytes per token · max_seq_len))

``plan_memory`` is the arithmetic alone (pure, tested on the CPU); ``measure_plan`` reads
the GPU (``torch.cuda.mem_get_info``) and the model and calls it. A colocated engine plans even
without ``--engine-mem-fraction`` (``COLOCATED_FRACTION``, the trainer's peak from
``colocated_trainer_peak``): without a plan it would take ``max_batch_size`` slots of KV and
leave the trainer's first step to run out of memory. A plan that cannot hold one
sequence of ``max_seq_len`` tokens raises ``MemoryPlanError`` naming the knobs, before any
request is taken; ``EmbeddedEngine`` then builds ``slots`` slots instead of
``max_batch_size`` (more requests wait in its queue).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GiB = 1 << 30
COLOCATED_FRACTION = 0.9  # a colocated engine's plan without --engine-mem-fraction: the rest is CUDA contexts and allocator slack


class MemoryPlanError(ValueError):
    """Not even one sequence fits; the message says which knob to turn."""


@dataclass(frozen=True)
class MemoryPlan:
    total_bytes: int
    fraction: float
    in_use_bytes: int  # weights (and a colocated trainer's resident state) already allocated
    weights_bytes: int  # the engine's weights (part of in_use_bytes)
    trainer_peak_bytes: int  # what a colocated trainer adds at its peak beyond what it holds now
    activation_bytes: int
    margin_bytes: int
    kv_bytes_per_token: int
    max_seq_len: int
    kv_tokens: int  # tokens the budget holds
    slots: int  # KV-cache slots the engine builds

    @property
    def kv_bytes(self) -> int:
        return self.slots * self.max_seq_len * self.kv_bytes_per_token

    def describe(self) -> str:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        return (f"memory plan: {g(self.total_bytes)} x {self.fraction:g} | in use {g(self.in_use_bytes)} "
                f"(engine weights {g(self.weights_bytes)}) | trainer peak {g(self.trainer_peak_bytes)} | "
                f"activations {g(self.activation_bytes)} | margin {g(self.margin_bytes)} | KV cache "
                f"{g(self.kv_bytes)}: {self.kv_tokens} tokens, {self.slots} slots x {self.max_seq_len}")


def plan_memory(*, total_bytes: int, fraction: float, in_use_bytes: int, weights_bytes: int,
                kv_bytes_per_token: int, max_seq_len: int, max_batch_size: int,
                trainer_peak_bytes: int = 0, activation_bytes: int = 0, margin_bytes: int = 0) -> MemoryPlan:
    if not 0 < fraction <= 1:
        raise MemoryPlanError(f"--engine-mem-fraction must be in (0, 1], got {fraction}")
    budget = int(total_bytes * fraction) - in_use_bytes - trainer_peak_bytes - activation_bytes - margin_bytes
    kv_tokens = max(0, budget) // kv_bytes_per_token
    slots = min(max_batch_size, kv_tokens // max_seq_len)
    plan = MemoryPlan(total_bytes, fraction, in_use_bytes, weights_bytes, trainer_peak_bytes, activation_bytes,
                      margin_bytes, kv_bytes_per_token, max_seq_len, kv_tokens, slots)
    if slots < 1:
        need = max_seq_len * kv_bytes_per_token
        raise MemoryPlanError(
            f"one sequence of --max-seq-len {max_seq_len} needs {need / GiB:.2f} GiB of KV cache, but "
            f"{max(0, budget) / GiB:.2f} GiB is left ({plan.describe()}); raise --engine-mem-fraction, lower "
            f"--max-seq-len, --max-tokens-per-micro-batch or --train-memory-margin-bytes, use --kv-cache-dtype fp8_e4m3, --lora-rank or "
            f"--offload-train")
    return plan


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K+V bytes of one token over all layers."""
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * size


def activation_bytes(config, max_batch_size: int, max_prefill_tokens: int, dtype: torch.dtype) -> int:
    """A bound on the engine's transient tensors: float32 logits of a decode batch (and their
    softmax), and a prefill chunk's widest layer intermediates."""
    size = torch.empty((), dtype=dtype).element_size()
    logits = 3 * max_batch_size * config.vocab_size * 4
    width = max(config.intermediate_size * 2, (config.num_attention_heads + 2 * config.num_key_value_heads)
                * config.head_dim, config.hidden_size * 4)
    return logits + 2 * max_prefill_tokens * width * size


def trainer_activation_bytes(config, tokens: int, dtype: torch.dtype, *, checkpointing: bool = False) -> int:
    """A bound on what one training micro-batch of ``tokens`` tokens allocates beyond the
    trainer's resident state: the tensors autograd saves in each decoder layer (the layer's
    input alone under gradient checkpointing, plus one layer recomputed), and the logits with
    their gradient in the compute dtype beside the float32 log-softmax chunks."""
    from miles.trainers.logprobs import CHUNK_BYTES

    size = torch.empty((), dtype=dtype).element_size()
    h = config.hidden_size
    mlp = (config.moe_intermediate_size * config.num_experts_per_tok if config.num_experts
           else config.intermediate_size)
    attn = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    # norms, residuals and attention out (h each), gate/up and SiLU·up, q/k/v before and after
    # RoPE; the RMSNorms (the two of the layer, q and k's) also keep their float32 inputs
    norms = 2 * h + (config.num_attention_heads + config.num_key_value_heads) * config.head_dim
    layer = (8 * h + 3 * mlp + 2 * attn) * size + 4 * norms
    saved = (h * size * config.num_hidden_layers + layer) if checkpointing else layer * config.num_hidden_layers
    return tokens * (saved + 2 * config.vocab_size * size) + 3 * CHUNK_BYTES


def colocated_trainer_peak(state_bytes: int, activation_bytes: int, other_in_use_bytes: int) -> int:
    """What a colocated trainer still adds at its peak: its activations, and whatever of its
    resident state is not allocated yet. The engine cannot tell the trainer's allocations from
    other processes', so memory in use beyond its own weights counts as the trainer's state
    (the two actors start concurrently: either may allocate first)."""
    return activation_bytes + max(0, state_bytes - other_in_use_bytes)


def measure_plan(model, engine_config, kv_dtype: torch.dtype, *, trainer: tuple[int, int] | None = None) -> MemoryPlan:
    """The plan on the engine's CUDA device, with its weights already there. ``trainer``: a
    colocated trainer's (resident state bytes, micro-batch activation bytes)."""
    device = torch.device(engine_config.device)
    free, total = torch.cuda.mem_get_info(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainer_peak_bytes = 0
    if trainer is not None:
        trainer_peak_bytes = colocated_trainer_peak(*trainer, other_in_use_bytes=max(0, total - free - weights))
    fraction = engine_config.engine_mem_fraction or COLOCATED_FRACTION
    return plan_memory(
        total_bytes=total, fraction=fraction, in_use_bytes=total - free,
        weights_bytes=weights, kv_bytes_per_token=kv_bytes_per_token(model.config, kv_dtype),
        max_seq_len=engine_config.max_seq_len, max_batch_size=engine_config.max_batch_size,
        trainer_peak_bytes=trainer_peak_bytes,
        activation_bytes=activation_bytes(model.config, engine_config.max_batch_size,
                                          engine_config.max_prefill_tokens, engine_config.torch_dtype()),
        margin_bytes=engine_config.train_memory_margin_bytes)


def trainer_state_bytes(num_params: int, trainable_params: int, *, offload_train: bool = False,
                        lora: bool = False, base_bytes: int = 2) -> int:
    """Bytes an embedded trainer keeps: float32 weights, and for each trainable parameter a
    float32 gradient and two AdamW moments (on the host between steps with --offload-train).
    A LoRA trainer (``num_params`` the base's, ``trainable_params`` the adapters') keeps its
    frozen base in the compute dtype (``base_bytes`` each: 2 for bf16) and float32 adapters."""
    if lora:
        return base_bytes * num_params + 4 * trainable_params + (0 if offload_train else 12 * trainable_params)
    return 4 * num_params + (0 if offload_train else 12 * trainable_params)
