"""MegatronTrainer: the policy trainer (``TrainerBackend``) on megatron-core, for TP / PP / EP /
CP / DP layouts of Qwen3 and Qwen3-MoE models.

The RL step is the embedded trainer's, ``miles.trainers.step.RLStep``: the same batching
(``batching.build_batch``, ``plan_micro_batches``), advantages, reference and proximal
log-probs, mini-batches, loss (``compute_loss`` with mini-batch denominators), non-finite
step skipping, LR schedule (``lr_at``) and metrics. This class is its backend: log-probs from
Megatron's hidden states (logits / rollout_temperature; ``linear_logprobs`` when the vocab is
not split), and from Megatron the model (``model.build_gpt``), ``DistributedDataParallel``,
its optimizer (AdamW; fp32 master weights under bf16, global grad-norm clipping) and the
micro-batch schedule (``get_forward_backward_func``: 1F1B across pipeline stages). It has no
out-of-memory retry: one rank's retry would leave the others waiting in a collective.

Every rank runs every method (SPMD): each gets the same groups, and data-parallel rank d trains
rows d, d + dp, ... of each mini-batch sorted by length. The loss of a micro-batch is
normalised by the counts of the *whole* mini-batch, and the TransformerConfig sets
``calculate_per_token_loss`` so the schedule does not rescale it and DDP sums (not averages)
gradients over data-parallel ranks: the summed gradient is exactly the single-process gradient
of the mini-batch loss. Metrics are combined over data-parallel ranks and sent from the last
pipeline stage to every rank.

CUDA only: megatron-core's forward places tensors on the current CUDA device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.algorithms import AlgorithmConfig
from miles.models import ModelConfig, load_config
from miles.trainers.batching import TokenBatch, build_batch
from miles.trainers.config import TrainerConfig, lr_at
from miles.trainers.megatron import state as ckpt
from miles.trainers.megatron.config import MegatronConfig, MegatronConfigError
from miles.trainers.megatron.distributed import Layout, groups, init_parallel
from miles.trainers.megatron.mapping import check_trainable, padded_vocab_size
from miles.trainers.megatron.model import (
    build_gpt,
    hidden_states_only,
    naming_for,
    output_weight,
    require_megatron,
    unwrap,
)
from miles.trainers.megatron.replay import RoutingReplay
from miles.trainers.megatron.sequence import MicroBatch, make_micro_batch, replay_targets, response_logprobs
from miles.trainers.megatron.weights import HFReader, export_hf, load_hf, mapping_getter
from miles.trainers.step import LOSS_SUMS, MicroLoss, RLStep
from miles.transports.weights import plan_buckets
from miles.types import Trajectory

Weights = str | Path | Mapping[str, Tensor] | None


def _dtype(name: str) -> torch.dtype:
    """``--dtype``; "auto" is bfloat16 here (Megatron trains on CUDA only), as for the embedded
    trainer on CUDA."""
    return {"auto": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class MegatronTrainer(RLStep):
    """Trains a Megatron ``GPTModel`` built from an HF config with ``miles.algorithms``."""

    def __init__(self, model: ModelConfig, *, config: TrainerConfig, algo: AlgorithmConfig,
                 megatron: MegatronConfig | None = None, weights: Weights = None, version: int = 0) -> None:
        require_megatron()
        if algo.advantage_estimator == "ppo":
            raise ValueError("advantage_estimator='ppo' needs critic values; the Megatron trainer has no critic yet")
        if not config.device.startswith("cuda") or not torch.cuda.is_available():
            raise ValueError(f"the Megatron trainer needs CUDA (TrainerConfig.device={config.device!r}, "
                             f"cuda available: {torch.cuda.is_available()})")
        needs_ref = algo.kl_coef > 0 or algo.reward_kl_coef > 0
        if needs_ref and weights is None:
            raise ValueError("kl_coef / reward_kl_coef > 0 needs a reference model: pass weights=")
        self.mcfg = megatron or MegatronConfig()
        check_trainable(model, self.mcfg)
        self.replay_on = config.use_rollout_routing_replay and model.is_moe
        recompute = config.gradient_checkpointing or self.mcfg.recompute_granularity is not None
        if self.replay_on and recompute and self.mcfg.pipeline_model_parallel_size > 1:
            raise MegatronConfigError("pipeline_model_parallel_size", "routing replay with activation "
                                      "recomputation is not supported across pipeline stages")
        super().__init__(config=config, algo=algo, version=version)
        self.model_cfg = model
        self.dtype = _dtype(config.dtype)
        self.layout: Layout = init_parallel(self.mcfg, device=config.device, seed=config.seed)
        self.grp = groups() if dist.get_world_size() > 1 else {}
        self.device = torch.device(torch.cuda.current_device())  # an int: cuda:<index>
        torch.manual_seed(config.seed)
        self.padded_vocab = padded_vocab_size(model.vocab_size, self.mcfg.make_vocab_size_divisible_by,
                                              self.layout.tp)
        self.gpt = self._build(weights, gradient_checkpointing=config.gradient_checkpointing)
        self.naming = naming_for(self.gpt.miles_impl)
        self.ddp, self.optimizer = self._wrap(self.gpt)
        self.replay = RoutingReplay(self.gpt, model.moe_layers) if self.replay_on else None
        self.ref = self.ref_replay = None
        if needs_ref:
            self.ref = self._build(weights, gradient_checkpointing=False).requires_grad_(False)
            self.ref_replay = RoutingReplay(self.ref, model.moe_layers) if self.replay_on else None

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> MegatronTrainer:
        """A trainer on the HF checkpoint directory ``path`` (config.json + safetensors)."""
        return cls(load_config(path), weights=path, **kwargs)

    # ---- construction -----------------------------------------------------------------------
    def _build(self, weights: Weights, *, gradient_checkpointing: bool) -> Any:
        gpt = build_gpt(self.model_cfg, self.mcfg, dtype=self.dtype, device=self.config.device,
                        gradient_checkpointing=gradient_checkpointing)
        if weights is not None:
            get = mapping_getter(weights) if isinstance(weights, Mapping) else HFReader(weights)
            load_hf(gpt, self.model_cfg, get, self.layout, naming_for(gpt.miles_impl), self.padded_vocab)
        return gpt

    def _wrap(self, gpt: Any) -> tuple[Any, Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        c, m = self.config, self.mcfg
        ddp = DistributedDataParallel(
            gpt.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                      use_distributed_optimizer=m.use_distributed_optimizer), gpt)

        def finalize(model: list[Any], num_tokens: Any = None, **kw: Any) -> None:
            # The loss is already normalised by global counts: reduce, never rescale by tokens.
            finalize_model_grads(model, None, **kw)

        gpt.config.finalize_model_grads_func = finalize
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=lr_at(0, c), min_lr=c.min_lr, weight_decay=c.weight_decay,
            adam_beta1=c.adam_beta1, adam_beta2=c.adam_beta2, adam_eps=c.adam_eps,
            # clip_grad 0 in miles means "no clipping but log the norm"; Megatron skips the
            # norm entirely at 0, so clip at +inf instead.
            clip_grad=c.clip_grad if c.clip_grad > 0 else float("inf"),
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
            use_distributed_optimizer=m.use_distributed_optimizer)
        return ddp, get_megatron_optimizer(opt_cfg, [ddp])

    # ---- TrainerBackend (train_step, compute_logprobs and version: RLStep) -----------------
    def export_weights(self, bucket_bytes: int, *,
                       dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, Tensor]]]:
        """Full HF-named tensors in buckets of at most ``bucket_bytes`` (a larger tensor is a
        bucket of its own); collective: every rank must iterate it to the end."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        yield from plan_buckets(export_hf(self.gpt, self.model_cfg, self.layout, self.naming, dtype=dtype,
                                          grp=self.grp), bucket_bytes)

    def state_dict(self) -> dict[str, Any]:
        return ckpt.trainer_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ckpt.load_trainer_state(self, state)

    # ---- RLStep hooks -----------------------------------------------------------------------
    def _batch(self, trajs: list[Trajectory], *, check_versions: bool = True) -> TokenBatch:
        cfg = self.model_cfg
        return build_batch(trajs, device=self.device, vocab_size=cfg.vocab_size,
                           routing_shape=(len(cfg.moe_layers), cfg.num_experts_per_tok) if self.replay_on else None,
                           current_version=self._version if check_versions else None)

    def _logprobs(self, batch: TokenBatch, *, reference: bool = False) -> Tensor | None:
        if reference:
            return self._no_grad_logprobs(self.ref, self.ref_replay, batch) if self.ref is not None else None
        return self._no_grad_logprobs(self.ddp, self.replay, batch)

    def _zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _forward_backward(self, batch: TokenBatch, rows: list[int], loss: MicroLoss, limits: TrainerConfig) -> None:
        """This rank's micro-batches of ``rows`` through Megatron's schedule; ``loss`` runs on
        the last pipeline stage."""
        entropy_mode = self._entropy_mode()

        def train_loss(mb: MicroBatch, gpt: Any, hidden: Tensor) -> tuple[Tensor, Tensor, dict]:
            logp, entropy = self._mb_logprobs(mb, gpt, hidden, entropy_mode)
            num_tokens = mb.tb.loss_mask.sum().to(torch.int)
            return loss(mb.tb, mb.rows, logp, entropy, weight=mb.weight), num_tokens, {}

        self._run(self.ddp, self.replay, self._micro_batches(batch, rows, limits, need_loss=True), train_loss,
                  forward_only=False)

    def _optimizer_step(self, finite: Tensor, lr: float) -> tuple[bool, float | None]:
        """Skipped (on every rank alike) unless the loss and every reduced gradient are finite."""
        if not self._all_finite(finite):
            self._zero_grad()
            return False, None
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.config.weight_decay * group.get("wd_mult", 1.0)
        _, grad_norm, _ = self.optimizer.step()
        return True, None if grad_norm is None else float(grad_norm)

    def _reduce_metrics(self, metrics: dict[str, float], tokens: float) -> dict[str, float]:
        """Combined over data-parallel ranks (loss parts summed, maxima maxed, the rest weighted
        by each rank's loss tokens), sent from the last stage to all."""
        if self.layout.dp > 1:
            parts: list[Any] = [None] * self.layout.dp
            dist.all_gather_object(parts, (metrics, tokens), group=self.grp["dp"])
            metrics = _combine(parts)
        if self.layout.pp > 1:
            box = [metrics]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.grp["pp"], self.layout.pp - 1),
                                       group=self.grp["pp"])
            metrics = box[0]
        return metrics

    # ---- micro-batches, forward / backward ----------------------------------------------------
    def _micro_batches(self, batch: TokenBatch, rows: Sequence[int], limits: TrainerConfig, *,
                       need_loss: bool) -> list[MicroBatch]:
        """This data-parallel rank's share of ``rows``, planned into micro-batches, padded with
        zero-weight placeholders to the largest count over data-parallel ranks: expert-parallel
        all-to-alls are collective per forward, so every rank must run as many micro-batches
        (and a rank left without rows still needs one step for DDP and the schedule)."""
        by_length = sorted(rows, key=lambda r: -batch.seq_lens[r])  # dealt round-robin: balanced ranks
        mine = by_length[self.layout.dp_rank::self.layout.dp]
        if need_loss:
            mine = [r for r in mine if batch.loss_tokens[r]]
        plan = batch.plan(mine, limits)
        count = max(len(plan), 1)
        if self.layout.dp > 1:
            n = torch.tensor(count, device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.grp["dp"])
            count = int(n.item())
        mbs = [make_micro_batch(batch.select(p), p, self.layout) for p in plan]
        filler = [rows[0]]
        mbs += [make_micro_batch(batch.select(filler), filler, self.layout, weight=0.0)
                for _ in range(count - len(plan))]
        return mbs

    def _run(self, model: Any, replay: RoutingReplay | None, mbs: list[MicroBatch],
             loss_fn: Callable[[MicroBatch, Any, Tensor], tuple[Tensor, Tensor, dict]], forward_only: bool) -> None:
        """One pass of Megatron's schedule over ``mbs``; ``loss_fn`` runs on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[MicroBatch], chunk: Any) -> tuple[Tensor, Callable]:
            mb = next(data_iterator)
            gpt = unwrap(chunk)
            if replay is not None:
                replay.set(*replay_targets(mb, len(self.model_cfg.moe_layers), self.model_cfg.num_experts_per_tok))
            with hidden_states_only(gpt):
                hidden = chunk(mb.input_ids, mb.position_ids, None)
            return hidden, functools.partial(loss_fn, mb, gpt)

        try:
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[model],
                num_microbatches=len(mbs), seq_length=max(mb.input_ids.shape[1] for mb in mbs),
                micro_batch_size=max(mb.input_ids.shape[0] for mb in mbs), forward_only=forward_only)
        finally:
            if replay is not None:
                replay.clear()

    def _mb_logprobs(self, mb: MicroBatch, gpt: Any, hidden: Tensor, entropy: str) -> tuple[Tensor, Tensor | None]:
        return response_logprobs(hidden, output_weight(gpt), mb, temperature=self.config.rollout_temperature,
                                 vocab_size=self.model_cfg.vocab_size, layout=self.layout, grp=self.grp,
                                 entropy=entropy)

    @torch.no_grad()
    def _no_grad_logprobs(self, model: Any, replay: RoutingReplay | None, batch: TokenBatch) -> Tensor:
        """[N, R] log-probs of ``batch`` on every rank (rows split over data-parallel ranks,
        then summed; the last pipeline stage broadcasts)."""
        out = torch.zeros_like(batch.logp_rollout)

        def collect(mb: MicroBatch, gpt: Any, hidden: Tensor) -> tuple[Tensor, Tensor, dict]:
            logp, _ = self._mb_logprobs(mb, gpt, hidden, "none")
            if mb.weight:
                out[torch.as_tensor(mb.rows, device=self.device), : logp.shape[1]] = logp
            return torch.zeros((), device=self.device), torch.ones((), dtype=torch.int, device=self.device), {}

        mbs = self._micro_batches(batch, range(batch.size), self.config, need_loss=False)
        self._run(model, replay, mbs, collect, forward_only=True)
        if self.layout.dp > 1:
            dist.all_reduce(out, group=self.grp["dp"])
        if self.layout.pp > 1:
            dist.broadcast(out, src=dist.get_global_rank(self.grp["pp"], self.layout.pp - 1), group=self.grp["pp"])
        return out

    def _all_finite(self, loss_finite: Tensor) -> bool:
        """Loss and every (reduced) gradient finite, agreed over all ranks."""
        grads = [p.main_grad for p in self.ddp.module.parameters() if getattr(p, "main_grad", None) is not None]
        ok = loss_finite.float()
        if grads:
            norms = torch.stack(torch._foreach_norm(grads))
            ok = ok * torch.isfinite(norms).all().float()
        if dist.get_world_size() > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item() > 0)


def _combine(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    keys = {k for r, _ in parts for k in r}
    out: dict[str, float] = {}
    for k in keys:
        vals = [(r[k], w) for r, w in parts if k in r]
        if k in LOSS_SUMS:
            out[k] = sum(v for v, _ in vals)
        elif k.endswith("_max"):
            out[k] = max(v for v, _ in vals)
        elif k == "train/grad_norm":
            out[k] = vals[0][0]
        else:
            total = sum(w for _, w in vals)
            out[k] = sum(v * w for v, w in vals) / total if total > 0 else sum(v for v, _ in vals) / len(vals)
    return out
