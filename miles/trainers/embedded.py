"""EmbeddedTrainer: the pure-PyTorch policy trainer (TrainerBackend), CPU or GPU.

The RL step (advantages, reference and proximal log-probs, mini-batches, loss, skipped
non-finite steps, metrics) is ``miles.trainers.step.RLStep``'s; this class is its backend:
the batch on its device, the forward (``logprobs``: the fused LM head + log-softmax) and
backward over micro-batches, global grad-norm clipping, AdamW and the LR schedule. An
out-of-memory error in a step restarts it with micro-batches half as big (``oom``), and
with ``offload_train`` the AdamW moments wait in host memory between steps (``offload``). On
the CPU the micro-batches run side by side on the cores the process would leave idle
(``parallel``) and the forward skips the padding and runs a prompt that several rows of a
micro-batch share (a GRPO group's) once (``logprobs.unpads``, ``TokenBatch.packed_positions``).

With ``lora_rank`` > 0 it trains LoRA adapters over frozen base weights (``lora``): the
optimizer, the checkpoint state and every weight update hold the adapters only.

Parameters and AdamW state are float32 (a LoRA run's frozen base: the compute dtype);
``dtype="bfloat16"`` runs forward/backward under autocast. On CUDA the decoder layers run under torch.compile, warmed up for
every micro-batch shape class (``compilation``): by default in a child process while the first
steps run eagerly, the layers switched to compiled between steps once it is done
(``compile_cache``), or at construction (``compile_warmup="inline"``). ``state_dict`` returns CPU copies of every
tensor plus plain Python values, so a checkpoint writer can store it with safetensors + JSON
without pickle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from miles.algorithms import AlgorithmConfig
from miles.algorithms.masked import deferred_finite_checks
from miles.models import invariant, quant
from miles.models.quant_io import wire_tensors
from miles.trainers import compilation, lora
from miles.trainers.compile_cache import BackgroundCompile
from miles.trainers import state as ckpt
from miles.trainers.batching import TokenBatch, build_batch
from miles.trainers.config import TrainerConfig, lr_at
from miles.trainers.fsdp import maybe_fully_shard, wants_fsdp
from miles.trainers.logprobs import full_routing, response_logprobs
from miles.trainers.offload import OptimizerOffloader
from miles.trainers.parallel import MicroBatchPool, cpu_helpers, finer_limits
from miles.trainers.oom import OOMGuard
from miles.trainers.step import MicroLoss, RLStep
from miles.types import Trajectory
from miles.transports.weights import plan_buckets
from miles.utils.device import to_device

log = logging.getLogger(__name__)


def _increment_version(params: list[Tensor]) -> None:
    from torch.autograd.graph import increment_version

    with torch.no_grad():
        increment_version(params)


def _dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _checkpoint_layers(model: nn.Module) -> None:
    from torch.utils.checkpoint import checkpoint

    for layer in model.model.layers:
        fwd = layer.forward

        def forward(*args: Any, _fwd: Any = fwd, **kw: Any) -> Any:
            if torch.is_grad_enabled():
                return checkpoint(_fwd, *args, use_reentrant=False, **kw)
            return _fwd(*args, **kw)

        layer.forward = forward


class EmbeddedTrainer(RLStep):
    """Trains a ``miles.models.CausalLM`` with the algorithms of ``miles.algorithms``."""

    def __init__(
        self,
        model: nn.Module,
        *,
        config: TrainerConfig,
        algo: AlgorithmConfig,
        ref_model: nn.Module | None = None,
        version: int = 0,
    ) -> None:
        if algo.advantage_estimator == "ppo":
            raise ValueError("advantage_estimator='ppo' needs critic values; the embedded trainer has no critic yet")
        if (algo.kl_coef > 0 or algo.reward_kl_coef > 0) and ref_model is None:
            raise ValueError("kl_coef / reward_kl_coef > 0 needs a reference model (ref_model=...)")
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"TrainerConfig.device={config.device!r} but CUDA is not available")
        super().__init__(config=config, algo=algo, version=version)
        self.device = torch.device(config.device)
        self.compute_dtype = _dtype(config.dtype, config.device)
        torch.manual_seed(config.seed)
        self.lora = config.lora_rank > 0
        if self.lora:  # before FSDP, compile and the optimizer: they see the adapters
            self.model = model.to(device=self.device)
            lora.apply_lora(self.model, config.lora_rank, config.lora_alpha, config.lora_dropout,
                            config.lora_target_modules)
            lora.cast_for_training(self.model, self.compute_dtype)  # the frozen base in the compute dtype
            if not wants_fsdp(config.fsdp):
                # q/k/v and gate/up as the engine's fused GEMMs read them: a colocated engine can
                # serve this base as is (``shared_base``)
                lora.fuse_frozen_base(self.model)
        else:
            self.model = model.to(device=self.device, dtype=torch.float32)
        self.model.train()
        self.is_moe = bool(getattr(model.config, "is_moe", False))
        self.sharded = maybe_fully_shard(self.model, config.fsdp, self.compute_dtype)
        # The fused LM-head log-prob path (see ``logprobs``); benchmarks flip it to compare.
        self.fused_logprobs = not self.sharded
        if config.gradient_checkpointing:
            _checkpoint_layers(self.model)
        compiled = config.compile
        if compiled is None:  # auto: see TrainerConfig.compile
            compiled = self.device.type == "cuda" and not self.is_moe and not self.sharded
        # in the background: a child fills the compile caches; the layers run eager until then
        background = bool(compiled) and self._warm_in_background()
        self.compiled = bool(compiled) and not background  # the layers run compiled now
        self.compile_stats: dict[str, float] = {}  # the warm-up's figures, reported once (perf/)
        self._background: BackgroundCompile | None = None
        self._train_calls = 0
        if self.compiled:
            compilation.compile_layers(self.model)
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.to(self.device).eval().requires_grad_(False)
        self.optimizer = self._build_optimizer()
        self.offloader = OptimizerOffloader(self.optimizer, self.device) if config.offload_train else None
        self.oom = OOMGuard(config)  # micro-batch limits, halved on an OOM (``oom``)
        helpers = cpu_helpers(self.device) if not self.sharded and quant.spec_of(self.model) is None else 0
        self._pool = MicroBatchPool(helpers) if helpers else None  # micro-batches on idle cores (``parallel``)
        if self.compiled:
            start = time.monotonic()
            self._warm_compiled()
            compilation.log_recompiles()
            self.compile_stats = {"perf/compile_warmup_s": time.monotonic() - start, "perf/compiled_from_step": 1.0}
        elif background:
            self._background = BackgroundCompile(self)

    def _warm_in_background(self) -> bool:
        mode = self.config.compile_warmup
        if mode == "auto":
            mode = "background" if self.device.type == "cuda" else "inline"
        # The child builds the plain model: a sharded or quantized one compiles other graphs.
        return mode == "background" and not self.sharded and quant.spec_of(self.model) is None

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
        self._train_calls += 1
        if self._background is not None and self._background.done():
            self._switch_to_compiled()  # between steps: never inside one
        return super().train_step(groups)

    def _switch_to_compiled(self) -> None:
        """The layers compiled and warmed up in-process: from the child's caches when it
        succeeded, from scratch (as the inline warm-up) when it failed."""
        bg, self._background = self._background, None
        assert bg is not None
        bg.ok()
        start = time.monotonic()
        compilation.compile_layers(self.model)
        self.compiled = True
        try:
            self._warm_compiled()
        except torch.OutOfMemoryError:  # an engine beside it holds more memory now than at start
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            log.warning("the compile warm-up ran out of memory at the switch; shapes it did not reach "
                        "compile when a step first meets them")
        compilation.log_recompiles()
        self.compile_stats = {"perf/compile_warmup_s": time.monotonic() - start,
                              "perf/compile_background_s": bg.seconds, "perf/compile_child_warmup_s": bg.warmup_s,
                              "perf/compiled_from_step": float(self._train_calls)}

    def __del__(self) -> None:
        bg = getattr(self, "_background", None)
        if bg is not None:
            bg.stop()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close()

    def _build_optimizer(self) -> torch.optim.Optimizer:
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": self.config.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        c = self.config
        return torch.optim.AdamW(groups, lr=lr_at(0, c), betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps,
                                 fused=self.device.type == "cuda")

    # ---- TrainerBackend (train_step, compute_logprobs and version: RLStep) -------------
    def export_weights(self, bucket_bytes: int, *, dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, Tensor]]]:
        """HF-named, detached, contiguous tensors in buckets of at most ``bucket_bytes``
        (a tensor larger than that is a bucket of its own). A tied LM head is sent once,
        as ``model.embed_tokens.weight``, as HF checkpoints store it."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if self.lora:  # the adapters alone: the engines keep the base weights they loaded
            yield from plan_buckets(lora.adapter_update(self.model, dtype=dtype), bucket_bytes)
            return
        spec = quant.spec_of(self.model)
        named = ckpt.named_weights(self.model, dtype=None if spec else dtype)
        if spec is not None:  # unified low precision: quantized from the master weights, as the forward is
            named = wire_tensors(named, spec, dtype)
        yield from plan_buckets(named, bucket_bytes)

    def shared_base(self) -> dict[str, Tensor]:
        """The frozen base's live tensors, HF-named, for a colocated engine to serve instead of
        a copy of its own (``miles.engines.shared``; LoRA trainers on one rank only)."""
        if not self.lora or self.sharded:
            raise ValueError("shared_base needs a LoRA trainer (--lora-rank > 0) on one rank")
        return lora.base_tensors(self.model)

    def save_adapter(self, directory: str, base_model_path: str | None = None) -> str:
        """Write the adapters in PEFT's format (LoRA runs only)."""
        if not self.lora:
            raise ValueError("save_adapter needs a LoRA trainer (--lora-rank > 0)")
        return str(lora.save_peft_adapter(self.model, directory, base_model_path))

    def export_merged(self, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
        """The policy as full HF-named weights (a LoRA trainer's adapters merged in), for --save-hf."""
        if not self.lora:
            yield from self.export_weights(bucket_bytes)
            return
        yield from plan_buckets(lora.merged_weights(self.model), bucket_bytes)

    def state_dict(self) -> dict[str, Any]:
        return ckpt.trainer_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ckpt.load_trainer_state(self, state)

    # ---- internals ----------------------------------------------------------------------
    def warm_shapes(self) -> list[tuple[int, int]]:
        """(rows, tokens per row) of the compiled trainer's warm-up micro-batches."""
        return compilation.warm_shapes(self.model.config.max_position_embeddings,
                                       self.config.max_tokens_per_micro_batch)

    def _warm_compiled(self) -> None:
        compilation.warm_up(self)

    def _forward(self, model: nn.Module, mb: TokenBatch, entropy: str) -> tuple[Tensor, Tensor | None]:
        routing = full_routing(model, mb, self.compute_dtype) if mb.routing is not None else None
        return response_logprobs(model, mb, temperature=self.config.rollout_temperature,
                                 dtype=self.compute_dtype, entropy=entropy, routing=routing,
                                 fused=self.fused_logprobs, compiled=self.compiled)

    def _no_grad_logprobs(self, model: nn.Module, batch: TokenBatch) -> Tensor:
        rows = range(batch.size)
        return self.oom.run(lambda cfg: self._no_grad_pass(model, batch, cfg), lambda cfg: batch.plan(rows, cfg),
                            batch.seq_lens, lambda: None)

    @torch.no_grad()
    def _no_grad_pass(self, model: nn.Module, batch: TokenBatch, config: TrainerConfig) -> Tensor:
        out = torch.zeros_like(batch.logp_rollout)
        for plan in batch.plan(range(batch.size), config):
            self.oom.check(plan)
            mb = batch.select(plan)
            logp, _ = self._forward(model, mb, "none")
            out[to_device(plan, torch.long, self.device), : logp.shape[1]] = logp
        return out

    def _clip_grad_norm(self) -> Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.device)
        max_norm = self.config.clip_grad if self.config.clip_grad > 0 else float("inf")
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    # ---- RLStep hooks -----------------------------------------------------------------------
    def _batch(self, trajs: list[Trajectory], *, check_versions: bool = True) -> TokenBatch:
        cfg = self.model.config
        replay = self.config.use_rollout_routing_replay and self.is_moe
        return build_batch(
            trajs, device=self.device, vocab_size=cfg.vocab_size,
            routing_shape=(len(cfg.moe_layers), cfg.num_experts_per_tok) if replay else None,
            current_version=self._version if check_versions else None,
            # where the forward runs on the packed tokens (``logprobs.unpads``): a group's prompt once
            share_prompts=(self.device.type == "cpu" and not replay and not self.compiled
                           and not invariant.serves(self.device)),
        )

    def _logprobs(self, batch: TokenBatch, *, reference: bool = False) -> Tensor | None:
        if reference:
            return self._no_grad_logprobs(self.ref_model, batch) if self.ref_model is not None else None
        return self._no_grad_logprobs(self.model, batch)

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def runs_gradless_rows(self) -> bool:  # type: ignore[override]
        """Eager dense layers on one rank only: a compiled layer would compile its no-grad
        form mid-run, FSDP ranks must run the same backward passes (their collectives), and an
        expert that only such rows reach would get a zero gradient where it now gets none."""
        return not self.compiled and self._background is None and not self.sharded and not self.is_moe

    def _forward_backward(self, batch: TokenBatch, rows: list[int], loss: MicroLoss, limits: TrainerConfig) -> None:
        entropy_mode = self._entropy_mode()
        live = [r for r in rows if r not in loss.gradless]
        idle = [r for r in rows if r in loss.gradless]
        forward_only = [] if loss.skip_gradless else idle
        if self._pool is not None:
            limits = finer_limits(limits, sum(batch.seq_lens[r] for r in live or idle), self._pool.threads)
        plan = [(mb_rows, grad) for part, grad in ((live, True), (forward_only, False)) for mb_rows in batch.plan(part, limits)
                if any(batch.loss_tokens[r] for r in mb_rows)]
        if self._pool is not None and len(plan) > 1:
            self._parallel_forward_backward(batch, plan, loss, entropy_mode)
        else:
            for mb_rows, grad in plan:
                self.oom.check(mb_rows)
                mb = batch.select(mb_rows)
                with torch.set_grad_enabled(grad):
                    logp, entropy = self._forward(self.model, mb, entropy_mode)
                    value = loss(mb, mb_rows, logp, entropy)
                if grad:
                    value.backward()
        if idle:
            # What the rows run forward only would have added: zeros. A parameter no other row
            # reached still takes its optimizer step (moments, weight decay) as before.
            for p in self.model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)

    def _parallel_forward_backward(self, batch: TokenBatch, plan: list[tuple[list[int], bool]], loss: MicroLoss,
                                   entropy_mode: str) -> None:
        """The loop above on the CPU's idle cores too (``parallel``). The loss records each
        micro-batch's metrics in plan order, as the loop does."""
        for mb_rows, _ in plan:
            self.oom.check(mb_rows)
        rotary = getattr(self.model, "rotary", None)
        if rotary is not None and max(batch.seq_lens) > rotary.length:  # grown once, before the threads
            rotary.reserve(max(batch.seq_lens), self.device)
        lock = threading.Lock()
        recorded: list[Any] = [None] * len(plan)

        def work(i: int) -> Tensor | None:
            rows, grad = plan[i]
            mb = batch.select(rows)
            with torch.set_grad_enabled(grad):
                logp, entropy = self._forward(self.model, mb, entropy_mode)
                with lock:
                    before = len(loss.pending)
                    value = loss(mb, rows, logp, entropy)
                    recorded[i] = loss.pending.pop() if len(loss.pending) > before else None
            return value if grad else None

        params = [p for p in self.model.parameters() if p.requires_grad]
        self._pool.run(len(plan), work, params, deferred_finite_checks)
        loss.pending.extend(r for r in recorded if r is not None)

    def _optimizer_step(self, finite: Tensor, lr: float) -> tuple[bool, Tensor | None]:
        grad_norm = self._clip_grad_norm()
        if not bool(finite & torch.isfinite(grad_norm)):  # the step's one device read
            self._zero_grad()
            return False, None
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.optimizer.defaults.get("fused"):
            # The fused step writes the parameters without moving their version counters, which
            # caches of derived weights key on (``quant.QuantLinear``'s quantized copy): without
            # this, the next forward would run the weights before the step.
            _increment_version([p for g in self.optimizer.param_groups for p in g["params"]])
        self._zero_grad()
        return True, grad_norm

    def _begin_update(self) -> None:
        if self.offloader is not None:
            self.offloader.reload()

    def _end_update(self) -> None:
        if self.offloader is not None:  # the engines generate next: the moments wait on the host
            self.offloader.offload()

    def _backend_metrics(self) -> dict[str, float]:
        metrics = {}
        if self.offloader is not None:
            metrics["mem/offload_train_s"] = self.offloader.seconds
        if self.compiled or self._background is not None:  # graphs dynamo built in this process: one more mid-run is a recompile
            from torch._dynamo.utils import counters

            metrics["perf/compiled_graphs"] = float(counters["stats"]["unique_graphs"])
            metrics["perf/compiled"] = float(self.compiled)
        metrics.update(self.compile_stats)  # once: the step that first ran compiled
        self.compile_stats = {}
        return metrics
