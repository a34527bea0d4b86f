"""EngineConfig: the embedded rollout engine's knobs (field names are the CLI flag names)."""

from __future__ import annotations

from typing import Literal

import msgspec
import torch

DECODE_ATTENTION = ("auto", "matmul", "sdpa", "triton")  # --decode-attention's choices

# --kv-cache-dtype's choices (SGLang's names): the model's dtype, or 8-bit floats.
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def chunk_problem(chunk: int) -> str | None:
    """What is wrong with a ``decode_attention_chunk`` value (completing "must be ..."), or None."""
    if chunk != 0 and (chunk < 64 or chunk & (chunk - 1)):
        return "0 (auto) or a power of two >= 64"
    return None


class EngineConfig(msgspec.Struct, kw_only=True):
    # KV-cache slots = the most requests decoding at once; more requests wait in a queue.
    max_batch_size: int = 64
    # Context length of one slot (prompt + response); ≤ the model's max_position_embeddings.
    max_seq_len: int = 2048
    # CUDA: size the KV cache from this share of the GPU's memory (miles.engines.memory);
    # None keeps max_batch_size slots whatever memory is left.
    engine_mem_fraction: float | None = None  # share of GPU memory the plan may use (None: no plan)
    train_memory_margin_bytes: int = 2 << 30  # memory the plan leaves free (trainer activations, fragmentation)
    device: str = "cpu"  # "cpu" or "cuda" (the engines; the trainer's is the same flag)
    # "auto": float32 on the CPU, bfloat16 on CUDA; or "float32" / "bfloat16" / "float16".
    dtype: str = "auto"
    # Default for weight updates: keep in-flight requests' KV cache (PipelineRL) or
    # recompute it with the new weights (AReaL).
    keep_kv_cache_on_update: bool = True
    # Most prompt tokens (padded) prefilled in one forward; a longer prompt goes alone.
    max_prefill_tokens: int = 8192
    # Continuous batching admits waiting requests into free slots. Every admission drains the
    # step in flight and runs a prefill forward, whose cost on a GPU is mostly fixed (an eager
    # forward's kernel launches, ~ms) — so while requests finish one or two per step, as RL's
    # long-tailed rollouts do, admitting each at once costs a prefill per decode step. While
    # others decode, waiting requests are admitted once an admission would take ``admit_min``
    # of them (that many waiting and that many free slots) or the oldest has waited
    # ``admit_max_wait_steps`` steps; an idle engine admits at once. None = auto: max_batch_size // 16 (at least 1) on
    # CUDA, 1 on the CPU (a prefill there costs its tokens, not a fixed overhead: batching
    # measured 0.98-1.01x); admit_max_wait_steps 0 = admit every step.
    admit_min: int | None = None
    admit_max_wait_steps: int = 8
    # Decode reads the KV cache up to the longest context rounded up to this (0 = auto:
    # 128 on CUDA so CUDA graphs see few shapes, 16 on the CPU).
    kv_block: int = 0
    # "sdpa" (torch's fused kernel) or "matmul" (explicit q·Kᵀ, softmax, ·V) for decode and
    # verify steps, both reading every row up to the batch's longest context; "triton"
    # (CUDA, miles.kernels) reads each row only up to its own length. "auto": matmul on the
    # CPU (16% faster per tiny-model step than SDPA with a mask, which takes a slow path
    # there); on CUDA triton where its probe launch works (triton installed, a power-of-two
    # head dim ≥ 16, a GPU it compiles for), sdpa otherwise.
    decode_attention: str = "auto"
    # Long-tail decode: when a few rows' contexts are much longer than the rest, read the
    # short range for every row and the long range for those rows only (matmul attention;
    # runner.choose_split). None = auto: on where decode runs eagerly (the CPU, MoE, no CUDA
    # graphs); True also bypasses the CUDA graphs on the steps it splits, which loses on a GPU
    # (benchmarks/long_tail_decode.py): there the triton attention is the answer.
    decode_split: bool | None = None
    # CUDA graphs for dense decode steps and short prefills (ignored on the CPU and for MoE
    # models; prefills stay eager in deterministic mode).
    cuda_graphs: bool = True
    # Capture the decode graph of every batch bucket not met yet while the engine is idle (one
    # per bucket with the triton attention, one bucket between two checks for work), so a
    # batch whose size wanders rarely stops for a capture; SGLang captures them all before
    # serving, which held the first request for seconds. Off: only when a bucket is first met.
    capture_graphs_when_idle: bool = True
    # torch.compile the layers' step functions (fuses RMSNorm/RoPE/SiLU/residual kernels).
    # None = auto: on for CUDA, off on the CPU (where it needs a C++ compiler and ~10 s).
    compile: bool | None = None
    # When the compiled step functions get ready (miles.engines.warmup): "background": the engine
    # serves at once with the eager step functions (CUDA graphs captured over them) while a child
    # process compiles the same shapes on a one-layer model, filling torch's on-disk caches; the
    # engine then switches between steps (when idle, else at a weight commit) by compiling from
    # those caches and re-capturing its graphs. "inline": compiled and warmed up before the engine
    # serves anything. "auto": background on CUDA; inline on the CPU, where the child would take
    # the cores the eager steps need. Speculative engines and --deterministic compile inline.
    # Shared with the trainer's field of the same name (one --dev compile_warmup sets both).
    compile_warmup: Literal["auto", "background", "inline"] = "auto"
    # The CPU decode step in one C call (miles.kernels.cpu_decode; built with the machine's C
    # compiler on first use; it reads each row's KV up to its own position). None = auto: on
    # for dense float32 models on the CPU where it builds, unless a torch attention was asked
    # for (decode_attention or decode_split set) or --deterministic; torch ops otherwise.
    # False = always torch ops; True = fail where it cannot run.
    cpu_decode_kernel: bool | None = None
    # Draw the tokens of a step without top-k/top-p in one Triton pass over its logits
    # (miles.kernels.sampling) instead of ~15 torch kernels, a fifth of a large batch's decode
    # step on a GPU. None = auto: on CUDA where its probe draw matches the
    # torch path's; False = torch ops; True = fail where it cannot run.
    fused_sampling: bool | None = None
    # Storage of the KV cache: "auto" (the engine's dtype) or "fp8_e4m3" / "fp8_e5m2", which
    # halve its memory (twice the slots or the context in the same memory) and the bytes a
    # decode step reads from it (V stored transposed, so the Triton attention reads 8-bit V as
    # it reads K; benchmarks/decode_attention.py compares the cache forms). Values are
    # stored unscaled (scale 1, as SGLang's default without calibrated scales), clamped to the
    # format's range, and read back into the engine's dtype for the attention math; prefill
    # attends over its own unrounded K/V. The rollout log-probs then differ slightly more from
    # the trainer's (engines/CONSISTENCY.md): the off-policy corrections (--use-tis) see it as
    # mismatch.
    kv_cache_dtype: str = "auto"
    # With the triton decode attention, its kernel applies the q/k RMSNorms and RoPE to the raw
    # projections itself (three launches a layer fewer; miles.kernels.decode_attention.Rope).
    # False: the compiled layer functions apply them first (the A/B of benchmarks/engine.py).
    decode_fuse_rope: bool = True
    # Decode steps add the attention output and MLP projections into the residual stream inside
    # their GEMMs (cuBLAS beta = 1; models.fused.residual_gemm_mlp): two kernels a layer fewer,
    # and a faster step at every batch size benchmarks/engine.py --side compares. The sum is
    # rounded once, not twice (engines/CONSISTENCY.md). False: a GEMM, then an add.
    decode_residual_gemm: bool = True
    # With decode_residual_gemm, the MLP's gate/up GEMM and SiLU·up run as one Triton kernel
    # (miles.kernels.gate_up) instead of cuBLAS and a SiLU·up kernel: one launch a layer fewer,
    # faster than the pair from 8 rows up (benchmarks/decode_mlp.py). Used on CUDA
    # where its probe launch matches torch's GEMMs; False: the two launches (the A/B of
    # benchmarks/engine.py).
    decode_fused_mlp: bool = True
    # Positions per program of the Triton decode attention (its CHUNK; 0 = auto: 256 in grids of
    # fewer than 128 rows × KV heads, else 1024; miles.kernels.decode_attention.default_launch). For
    # A/B runs (benchmarks/engine.py --side) and tuning; a power of two ≥ 64.
    decode_attention_chunk: int = 0
    # Seed of the generator for requests that carry no seed of their own.
    seed: int = 0
    # Batch-invariant numerics (the run's --deterministic): every decode step runs the full
    # max_batch_size rows over the whole cache length, and each prompt is prefilled alone, so
    # a request's logits never depend on which other requests share its batch. Slower.
    deterministic: bool = False
    # Colocated turns: the engine's KV cache and weights (refilled by the next weight update,
    # or from a pinned host copy where updates carry adapters or changed tensors only).
    offload_rollout: bool = False  # free the engines' KV cache and weights while the trainer runs (--colocate)
    # Test seam (a developer setting): the engine steps, counted from 1 over its life
    # (every prefill admission and decode step), at which it raises torch.OutOfMemoryError,
    # as a GPU that ran out would (miles.engines.oom).
    inject_oom_steps: list[int] = msgspec.field(default_factory=list)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if torch.device(self.device).type == "cpu" else torch.bfloat16
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        except KeyError:
            raise ValueError(f"dtype {self.dtype!r} not in auto/float32/bfloat16/float16") from None

    def kv_torch_dtype(self) -> torch.dtype:
        """The dtype the KV cache stores."""
        try:
            return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype()
        except KeyError:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} not in {'/'.join(KV_CACHE_DTYPES)}") from None

    def use_compile(self) -> bool:
        if self.compile is None:
            return torch.device(self.device).type == "cuda"
        return self.compile

    def warm_in_background(self) -> bool:
        """Whether the compiled step functions come from a background child (``compile_warmup``).
        Never in deterministic mode: the switch, whose step depends on the child's wall time,
        would change the numerics at a step no seed fixes."""
        if not self.use_compile() or self.deterministic:
            return False
        if self.compile_warmup == "auto":
            return torch.device(self.device).type == "cuda"
        return self.compile_warmup == "background"

    def use_cpu_decode_kernel(self) -> bool:
        if self.deterministic:  # batch-invariant padded steps: the torch path
            return False
        if self.cpu_decode_kernel is None:
            if self.kv_cache_dtype != "auto":  # the C kernel reads a float32 cache
                return False
            return self.decode_attention == "auto" and self.decode_split is None
        return self.cpu_decode_kernel

    def use_fused_sampling(self) -> bool:
        if self.fused_sampling is False or (self.fused_sampling is None and torch.device(self.device).type != "cuda"):
            return False
        from miles.engines.sampling import fused_failure

        reason = fused_failure(str(torch.device(self.device)))
        if reason is not None and self.fused_sampling:
            raise ValueError(f"fused_sampling cannot run here: the kernel {reason}")
        return reason is None

    def attention_mode(self, head_dim: int) -> str:
        from miles.kernels import decode_attention as kernel

        if self.decode_attention != "auto":
            return self.decode_attention
        if torch.device(self.device).type == "cpu":
            return "matmul"
        if kernel.failure(self.device, self.torch_dtype(), head_dim, self.kv_torch_dtype()) is None:
            return "triton"
        return "sdpa"

    def admit_threshold(self) -> int:
        if self.admit_min is not None:
            return self.admit_min
        return max(1, self.max_batch_size // 16) if torch.device(self.device).type == "cuda" else 1

    def block(self) -> int:
        if self.kv_block > 0:
            return self.kv_block
        return 16 if torch.device(self.device).type == "cpu" else 128

    def validate(self, max_position_embeddings: int, head_dim: int) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 1 < self.max_seq_len <= max_position_embeddings:
            raise ValueError(f"max_seq_len {self.max_seq_len} not in (1, max_position_embeddings="
                             f"{max_position_embeddings}]")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention {self.decode_attention!r} not in {'/'.join(DECODE_ATTENTION)}")
        if self.decode_attention == "triton":
            from miles.kernels import decode_attention as kernel

            reason = kernel.failure(self.device, self.torch_dtype(), head_dim, self.kv_torch_dtype())
            if reason is not None:
                raise ValueError(f"decode_attention 'triton' cannot run here: the kernel {reason}")
        problem = chunk_problem(self.decode_attention_chunk)
        if problem is not None:
            raise ValueError(f"decode_attention_chunk must be {problem}, got {self.decode_attention_chunk}")
        if self.engine_mem_fraction is not None and not 0 < self.engine_mem_fraction <= 1:
            raise ValueError(f"engine_mem_fraction must be in (0, 1], got {self.engine_mem_fraction}")
        if self.train_memory_margin_bytes < 0:
            raise ValueError(f"train_memory_margin_bytes must be >= 0, got {self.train_memory_margin_bytes}")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.admit_min is not None and self.admit_min < 1:
            raise ValueError(f"admit_min must be >= 1 (or None for auto), got {self.admit_min}")
        if self.admit_max_wait_steps < 0:
            raise ValueError(f"admit_max_wait_steps must be >= 0, got {self.admit_max_wait_steps}")
        self.torch_dtype()
        self.kv_torch_dtype()
        if self.kv_cache_dtype != "auto" and self.cpu_decode_kernel and not self.deterministic:
            raise ValueError(f"cpu_decode_kernel=True cannot run with kv_cache_dtype {self.kv_cache_dtype!r}: "
                             "the CPU decode kernel reads a cache in the engine's own dtype")
