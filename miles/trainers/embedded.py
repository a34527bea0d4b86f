"""EmbeddedTrainer: the pure-PyTorch policy trainer (TrainerBackend), CPU or GPU.

With ``lora_rank`` > 0 it trains LoRA adapters over frozen base weights (``lora``): the
optimizer, the checkpoint state and every weight update hold the adapters only.

One ``train_step(groups)`` is one published policy version:

1. validate the trajectories and pad them into a ``TokenBatch`` (``batching``);
2. advantages per group from the rewards (``miles.algorithms.compute_advantages``);
3. optional no-grad passes: reference log-probs (KL term / metric, REINFORCE++ reward KL),
   and the proximal log-probs when ``prox_logp="recompute"`` and the batch is used for
   more than one optimizer step (with one step, π_prox is exactly the current forward's
   log-probs, detached — no extra pass);
4. ``num_steps_per_rollout`` optimizer steps over shuffled mini-batches, each accumulated
   over micro-batches: forward (``logprobs``), ``compute_loss``, backward; then global
   grad-norm clipping, AdamW and the LR schedule. A step whose log-probs, loss or gradient
   norm is not finite is skipped (gradients dropped) and counted; after
   ``max_consecutive_nonfinite`` in a row the trainer raises ``NonFiniteError``;
5. ``version += 1`` and metrics named ``train/...``.

Parameters and AdamW state are float32 (a LoRA run's frozen base: the compute dtype);
``dtype="bfloat16"`` runs forward/backward under autocast. On CUDA the decoder layers run under torch.compile, warmed up at construction for
every micro-batch shape class (``compilation``). ``state_dict`` returns CPU copies of every
tensor plus plain Python values, so a checkpoint writer can store it with safetensors + JSON
without pickle.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from miles.algorithms import AlgorithmConfig, PolicyBatch, compute_advantages, compute_loss
from miles.algorithms.losses import kl_estimate
from miles.algorithms.masked import deferred_finite_checks
from miles.models import quant
from miles.models.quant_io import wire_tensors
from miles.trainers import compilation, lora
from miles.trainers import state as ckpt
from miles.trainers.batching import TokenBatch, build_batch, rewards_of, trajectories_of
from miles.trainers.config import TrainerConfig, lr_at
from miles.trainers.fsdp import maybe_fully_shard
from miles.trainers.logprobs import full_routing, response_logprobs
from miles.trainers.metrics import MetricAccumulator, batch_metrics, check_on_policy, rollout_logprob_diff
from miles.trainers.offload import OptimizerOffloader
from miles.trainers.oom import OOMGuard
from miles.types import Trajectory
from miles.utils.device import to_device
from miles.transports.weights import plan_buckets


class NonFiniteError(FloatingPointError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient."""


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


class EmbeddedTrainer:
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
        self.config, self.algo = config, algo
        self.device = torch.device(config.device)
        self.compute_dtype = _dtype(config.dtype, config.device)
        torch.manual_seed(config.seed)
        self.lora = config.lora_rank > 0
        if self.lora:  # before FSDP, compile and the optimizer: they see the adapters
            self.model = model.to(device=self.device)
            lora.apply_lora(self.model, config.lora_rank, config.lora_alpha, config.lora_dropout,
                            config.lora_target_modules)
            lora.cast_for_training(self.model, self.compute_dtype)  # the frozen base in the compute dtype
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
        self.compiled = bool(compiled)
        if compiled:
            compilation.compile_layers(self.model)
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.to(self.device).eval().requires_grad_(False)
        self.optimizer = self._build_optimizer()
        self.offloader = OptimizerOffloader(self.optimizer, self.device) if config.offload_train else None
        self.oom = OOMGuard(config)  # micro-batch limits, halved on an OOM (``oom``)
        self._version = version
        self.optimizer_steps = 0
        self.consecutive_nonfinite = 0
        self.skipped_steps_total = 0
        self._shuffle = torch.Generator().manual_seed(config.seed)
        if compiled:
            self._warm_compiled()
            compilation.log_recompiles()

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

    # ---- TrainerBackend ---------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
        start = time.perf_counter()
        trajs, group_index = trajectories_of(groups)
        rewards = rewards_of(trajs, self.config.reward_key)
        batch = self._build(trajs)  # validates everything before any state changes
        trained_version = self._version
        rewards = rewards.to(self.device)
        acc = MetricAccumulator()
        logp_ref = self._no_grad_logprobs(self.ref_model, batch) if self.ref_model is not None else None
        advantages = self._advantages(batch, rewards, group_index, logp_ref)
        logp_prox = None
        if self.algo.prox_logp == "recompute" and self.config.num_steps_per_rollout > 1:
            logp_prox = self._no_grad_logprobs(self.model, batch)

        order = torch.randperm(batch.size, generator=self._shuffle).tolist()
        minis = [order[i :: self.config.num_steps_per_rollout] for i in range(self.config.num_steps_per_rollout)]
        skipped = 0
        if self.offloader is not None:
            self.offloader.reload()
        for i, rows in enumerate(minis):
            if rows:
                # Log-probs under the rollout's weights: the first mini-batch's forward, or
                # the recomputed proximal pass for the later ones (after an update).
                reference = logp_prox if logp_prox is not None else (None if i else "forward")
                skipped += not self._optimizer_step(batch, rows, advantages, logp_prox, logp_ref, acc,
                                                    reference, trained_version)
        if self.offloader is not None:  # the engines generate next: the moments wait on the host
            self.offloader.offload()
        self._version += 1

        metrics = acc.result()
        check_on_policy(metrics, self.config.true_on_policy_check, trained_version)
        metrics.update(batch_metrics(batch, rewards, trained_version, time.perf_counter() - start))
        metrics.update({
            "train/skipped_steps": float(skipped),
            "train/skipped_steps_total": float(self.skipped_steps_total),
            "train/optimizer_steps": float(self.optimizer_steps),
            "train/lr": float(self.optimizer.param_groups[0]["lr"]),
            "train/version": float(self._version),
            "mem/oom_recovered": float(self.oom.recovered),
        })
        if self.offloader is not None:
            metrics["mem/offload_train_s"] = self.offloader.seconds
        if self.compiled:  # graphs dynamo built in this process: one more mid-run is a recompile
            from torch._dynamo.utils import counters

            metrics["perf/compiled_graphs"] = float(counters["stats"]["unique_graphs"])
        return metrics

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Log-probs of every response token under the current weights (no gradient)."""
        if not trajectories:
            return []
        batch = self._build(list(trajectories), check_versions=False)
        logp = self._no_grad_logprobs(self.model, batch).cpu()
        return [logp[i, : n].tolist() for i, n in enumerate(batch.resp_lens)]

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

    def _build(self, trajs: list[Trajectory], *, check_versions: bool = True) -> TokenBatch:
        cfg = self.model.config
        replay = self.config.use_rollout_routing_replay and self.is_moe
        return build_batch(
            trajs, device=self.device, vocab_size=cfg.vocab_size,
            routing_shape=(len(cfg.moe_layers), cfg.num_experts_per_tok) if replay else None,
            current_version=self._version if check_versions else None,
        )

    def _micro_batches(self, batch: TokenBatch, rows: Sequence[int]) -> list[TokenBatch]:
        return [batch.select(p) for p in batch.plan(rows, self.oom.config)]

    def _forward(self, model: nn.Module, mb: TokenBatch, entropy: str) -> tuple[Tensor, Tensor | None]:
        routing = full_routing(model, mb, self.compute_dtype) if mb.routing is not None else None
        return response_logprobs(model, mb, temperature=self.config.rollout_temperature,
                                 dtype=self.compute_dtype, entropy=entropy, routing=routing,
                                 fused=self.fused_logprobs, compiled=self.compiled)

    def _entropy_mode(self) -> str:
        return "grad" if self.algo.entropy_coef > 0 else "metric"

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

    def _advantages(self, batch: TokenBatch, rewards: Tensor, group_index: list[int],
                    logp_ref: Tensor | None) -> Tensor:
        """[N, R] advantages, 0 off the loss mask."""
        kl = None
        if self.algo.reward_kl_coef > 0 and logp_ref is not None:
            kl = kl_estimate(batch.logp_rollout, logp_ref, self.algo.kl_type)
        adv = compute_advantages(
            self.algo.advantage_estimator, rewards, torch.tensor(group_index, device=self.device),
            loss_mask=batch.loss_mask, kl=kl, kl_coef=self.algo.reward_kl_coef, gamma=self.algo.gamma,
            lam=self.algo.lam, std_eps=self.algo.grpo_std_eps, std_level=self.algo.grpo_std_level,
            std_unbiased=self.algo.grpo_std_unbiased)
        if adv.ndim == 1:
            adv = adv[:, None].expand_as(batch.loss_mask)
        return adv * batch.loss_mask

    def _optimizer_step(self, batch: TokenBatch, rows: list[int], advantages: Tensor,
                        logp_prox: Tensor | None, logp_ref: Tensor | None, acc: MetricAccumulator,
                        reference: Tensor | str | None = None, trained_version: int | None = None) -> bool:
        """Accumulate gradients over the micro-batches of ``rows`` and step. Returns False
        if the step was skipped as non-finite. ``reference`` holds the log-probs under the
        rollout's weights for the engine/trainer comparison ("forward": this step's own
        forward, which runs before the update; None: not available for these rows)."""
        finite, pending = self.oom.run(
            lambda cfg: self._accumulate(batch, rows, advantages, logp_prox, logp_ref, cfg, reference,
                                         trained_version),
            lambda cfg: batch.plan(rows, cfg), batch.seq_lens,
            lambda: self.optimizer.zero_grad(set_to_none=True))
        grad_norm = self._clip_grad_norm()
        if not bool(finite & torch.isfinite(grad_norm)):  # the step's one device read
            self.optimizer.zero_grad(set_to_none=True)
            return self._nonfinite()
        for metrics, weight in pending:
            acc.add(metrics, weight=weight, sums=("train/loss", "train/pg_loss"))
        acc.end_group()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.optimizer_steps, self.config)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        self.consecutive_nonfinite = 0
        acc.add({"train/grad_norm": grad_norm.detach()}, weight=1.0)
        return True

    def _accumulate(self, batch: TokenBatch, rows: list[int], advantages: Tensor, logp_prox: Tensor | None,
                    logp_ref: Tensor | None, config: TrainerConfig, reference: Tensor | str | None,
                    trained_version: int | None) -> tuple[Tensor, list[tuple[dict[str, Tensor], float]]]:
        """Gradients of one optimizer step, micro-batch by micro-batch under ``config``'s limits."""
        den = batch.denominators(rows)
        entropy_mode = self._entropy_mode()
        # Finiteness is checked once per step, on the device: a check per micro-batch (or
        # inside each loss function) would make the host wait for the GPU every time, and a
        # host that waits cannot queue the next micro-batch's kernels meanwhile.
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        pending: list[tuple[dict[str, Tensor], float]] = []  # metrics kept only if the step is taken
        self.optimizer.zero_grad(set_to_none=True)
        with deferred_finite_checks():
            for mb_rows in batch.plan(rows, config):
                if not any(batch.loss_tokens[r] for r in mb_rows):
                    continue
                self.oom.check(mb_rows)
                mb = batch.select(mb_rows)
                logp, entropy = self._forward(self.model, mb, entropy_mode)
                R = logp.shape[1]
                sel = to_device(mb_rows, torch.long, self.device)
                mask = mb.loss_mask
                pb = PolicyBatch(
                    logp=logp, logp_rollout=mb.logp_rollout, advantages=advantages[sel, :R], loss_mask=mask,
                    logp_prox=(logp.detach() if logp_prox is None else logp_prox[sel, :R]),
                    versions=mb.versions, entropy=entropy,
                    logp_ref=None if logp_ref is None else logp_ref[sel, :R],
                )
                loss, metrics = compute_loss(pb, self.algo, trainer_version=self._version, denominators=den)
                if reference is not None:
                    ref = logp.detach() if isinstance(reference, str) else reference[sel, :R]
                    metrics.update(rollout_logprob_diff(ref, mb.logp_rollout, mask, mb.versions, trained_version,
                                                        mb.kv_versions))
                finite &= torch.isfinite(torch.where(mask > 0, logp.detach(), 0.0)).all() & torch.isfinite(loss)
                loss.backward()
                pending.append((metrics, float(sum(mb.loss_tokens))))
        return finite, pending

    def _clip_grad_norm(self) -> Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.device)
        max_norm = self.config.clip_grad if self.config.clip_grad > 0 else float("inf")
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def _nonfinite(self) -> bool:
        self.consecutive_nonfinite += 1
        self.skipped_steps_total += 1
        n, limit = self.consecutive_nonfinite, self.config.max_consecutive_nonfinite
        if not self.config.skip_nonfinite_steps or n >= limit:
            raise NonFiniteError(
                f"non-finite loss or gradient in {n} consecutive optimizer step(s) "
                f"(skip_nonfinite_steps={self.config.skip_nonfinite_steps}, max_consecutive_nonfinite={limit})"
            )
        return False
