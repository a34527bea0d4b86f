"""DraftLearner: trains a draft model on the policy's sampled tokens (pure PyTorch).

The DraftTrainer actor (``miles.actors.draft_trainer``) wraps it; benchmarks and tests use
it directly. Per micro-batch of trajectories (prompt + response, right-padded):

- ``draft`` (independent LM): cross-entropy of the draft's next-token logits on the
  response tokens the policy sampled (loss-mask 1: environment tokens are not the
  policy's), plus ``draft_kl_coef`` × KL(policy ‖ draft) at the rollout temperature when
  a policy copy is present;
- ``eagle`` (head): the policy copy runs once without gradient to give the final-norm
  hidden states h; entry i = (h_i, x_{i+1}) predicts x_{i+2} through the policy's LM head
  (cross-entropy, + KL as above), and its feature regresses onto h_{i+1} (smooth L1, as
  EAGLE trains, so that feeding its own features back for later draft steps works).

Why the hidden states are recomputed here rather than shipped from the rollout engines: a
hidden state is H numbers per token (8 KB per token for a 4096-wide model in bf16, ~2000×
the token id), so a 256 × 2k-token batch would move ~4 GB through the object store per
step; one no-grad forward of a policy copy costs about a third of a training step's
compute, yields the hidden states of the *current* policy (the one the engines now draft
for) rather than of the mixed stale versions that sampled the tokens, and gives the full
teacher distribution for the KL term and the ``draft/accept_est`` metric for free. The
policy copy follows the trainer through the WeightBroadcaster (pulled, never pushed, so
no one waits on it). An engine can still return hidden states (``pop_hidden_states``)
where shipping is cheap (colocated, same process).

Metrics: ``draft/loss`` (cross-entropy), ``draft/top1_acc`` (the draft's argmax is the
sampled token: greedy acceptance), ``draft/accept_est`` (Σ min(p, q): the expected
acceptance of rejection sampling), ``draft/kl``, ``draft/feature_loss`` (eagle).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.engines.weights import WeightStager
from miles.models.draft import EagleHead, draft_kind
from miles.models.model import CausalLM
from miles.types import Status, Trajectory

FEATURE_COEF = 1.0  # weight of the EAGLE feature regression


def usable(traj: Trajectory) -> bool:
    """A trajectory worth training on: not failed, with policy-sampled response tokens."""
    return traj.status is not Status.FAILED and any(traj.loss_mask)


class DraftLearner:
    def __init__(self, draft: nn.Module, *, policy: CausalLM | None = None, lr: float = 1e-4,
                 kl_coef: float = 0.0, temperature: float = 1.0, micro_batch_size: int = 16,
                 device: str = "cpu", clip_grad: float = 1.0, version: int = 0, policy_version: int = 0) -> None:
        self.kind = draft_kind(draft)
        if policy is None and (self.kind == "eagle" or kl_coef > 0):
            raise ValueError("an EAGLE head, or draft_kl_coef > 0, needs a copy of the policy")
        self.device = torch.device(device)
        self.draft = draft.to(device=self.device, dtype=torch.float32).train()
        self.draft.requires_grad_(True)
        self.policy = None
        if policy is not None:
            dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
            self.policy = policy.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
            self.policy_stager = WeightStager(self.policy, self.device, dtype)
        self.kl_coef, self.temperature, self.clip_grad = kl_coef, temperature, clip_grad
        self.micro_batch_size = micro_batch_size
        decay = [p for p in self.draft.parameters() if p.ndim >= 2]
        rest = [p for p in self.draft.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                                           lr=lr, weight_decay=0.0)
        self.version, self.policy_version, self.steps = version, policy_version, 0
        self.lock = threading.Lock()  # train steps vs state_dict / export / policy loads

    # ---- training -----------------------------------------------------------------------
    def train_on(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One optimizer step per micro-batch of usable trajectories; averaged metrics."""
        trajs = [t for t in trajectories if usable(t)]
        sums: dict[str, float] = {}
        n = 0
        for i in range(0, len(trajs), self.micro_batch_size):
            with self.lock:
                loss, metrics = self._loss(trajs[i : i + self.micro_batch_size], grad=True)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                gn = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.clip_grad)
                if torch.isfinite(gn):
                    self.optimizer.step()
                    self.steps += 1
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            n += 1
        out = {k: v / n for k, v in sums.items()} if n else {}
        out["draft/trajectories"] = float(len(trajs))
        return out

    @torch.no_grad()
    def evaluate(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        trajs = [t for t in trajectories if usable(t)]
        sums: dict[str, float] = {}
        n = 0
        for i in range(0, len(trajs), self.micro_batch_size):
            _, metrics = self._loss(trajs[i : i + self.micro_batch_size], grad=False)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            n += 1
        return {k: v / n for k, v in sums.items()} if n else {}

    def _batch(self, trajs: Sequence[Trajectory]) -> tuple[Tensor, Tensor]:
        """ids [B, S] (right-padded) and mask [B, S]: 1 where the token is a policy-sampled
        response token (the draft's targets)."""
        seqs = [t.prompt_tokens + t.response_tokens for t in trajs]
        S = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), S, dtype=torch.long)
        mask = torch.zeros(len(seqs), S, dtype=torch.bool)
        for b, (t, s) in enumerate(zip(trajs, seqs)):
            ids[b, : len(s)] = torch.tensor(s)
            P = len(t.prompt_tokens)
            mask[b, P : P + len(t.response_tokens)] = torch.tensor(t.loss_mask, dtype=torch.bool)
        return ids.to(self.device), mask.to(self.device)

    def _loss(self, trajs: Sequence[Trajectory], *, grad: bool) -> tuple[Tensor, dict[str, float]]:
        ids, mask = self._batch(trajs)
        with torch.set_grad_enabled(grad):
            if self.kind == "eagle":
                return self._eagle_loss(ids, mask)
            return self._lm_loss(ids, mask)

    def _lm_loss(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
        sel = mask[:, 1:]  # position t predicts token t + 1
        logits = self.draft(ids).logits[:, :-1][sel]
        labels = ids[:, 1:][sel]
        teacher = None
        if self.policy is not None:
            with torch.no_grad():
                h = self.policy(ids, return_logits=False, return_hidden=True).hidden[:, :-1][sel]
                teacher = self.policy.lm_head(h).float()
        return self._token_losses(logits, labels, teacher)

    def _eagle_loss(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
        assert self.policy is not None
        with torch.no_grad():
            h = self.policy(ids, return_logits=False, return_hidden=True).hidden.float()
        head: EagleHead = self.draft  # type: ignore[assignment]
        feats = head(h[:, :-1], ids[:, 1:], self.policy.model.embed_tokens)  # entry i → x_{i+2}
        sel = mask[:, 2:]
        f = feats[:, :-1][sel]
        logits = F.linear(f.to(self.policy.lm_head.weight.dtype), self.policy.lm_head.weight).float()
        with torch.no_grad():
            teacher = self.policy.lm_head(h[:, 1:-1][sel].to(self.policy.lm_head.weight.dtype)).float()
        loss, metrics = self._token_losses(logits, ids[:, 2:][sel], teacher)
        feature = F.smooth_l1_loss(f, h[:, 1:-1][sel]) if f.numel() else f.sum()
        metrics["draft/feature_loss"] = float(feature.detach())
        return loss + FEATURE_COEF * feature, metrics

    def _token_losses(self, logits: Tensor, labels: Tensor, teacher: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        if labels.numel() == 0:
            zero = logits.sum() * 0.0
            return zero, {"draft/loss": 0.0, "draft/tokens": 0.0}
        ce = F.cross_entropy(logits, labels)
        metrics = {"draft/loss": float(ce.detach()), "draft/tokens": float(labels.numel()),
                   "draft/top1_acc": float((logits.argmax(-1) == labels).float().mean())}
        loss = ce
        if teacher is not None:
            T = self.temperature
            logq = F.log_softmax(logits / T, -1)
            logp = F.log_softmax(teacher / T, -1)
            kl = (logp.exp() * (logp - logq)).sum(-1).mean()
            metrics["draft/kl"] = float(kl.detach())
            metrics["draft/accept_est"] = float(torch.minimum(logp.exp(), logq.detach().exp()).sum(-1).mean())
            if self.kl_coef > 0:
                loss = loss + self.kl_coef * kl
        return loss, metrics

    # ---- weights ------------------------------------------------------------------------
    def load_policy_weights(self, named: Iterable[tuple[str, Any]], version: int) -> None:
        """New policy weights for the policy copy (all of them, then ``version`` flips)."""
        if self.policy is None:
            self.policy_version = version
            return
        with self.lock:
            self.policy_stager.stage(named)
            self.policy_stager.apply()
            self.policy_version = version

    def export_weights(self) -> list[tuple[str, Tensor]]:
        """The draft's tensors by name, CPU copies (a tied LM head is sent once)."""
        tied = bool(getattr(self.draft.config, "tie_word_embeddings", False)) and isinstance(self.draft, CausalLM)
        with self.lock:
            return [(k, v.detach().to("cpu", copy=True)) for k, v in self.draft.state_dict().items()
                    if not (tied and k == "lm_head.weight")]

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            opt = self.optimizer.state_dict()
            return {
                "model": {k: v.detach().to("cpu", copy=True) for k, v in self.draft.state_dict().items()},
                "optimizer": {
                    "state": {str(i): {k: (v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v)
                                       for k, v in s.items()} for i, s in opt["state"].items()},
                    "param_groups": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
                                     for g in opt["param_groups"]],
                },
                "draft": {"version": self.version, "steps": self.steps, "policy_version": self.policy_version,
                          "kind": self.kind},
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = self.draft.state_dict()
        got = state["model"]
        if set(own) != set(got):
            raise ValueError(f"draft state does not fit this draft: missing {sorted(set(own) - set(got))[:5]}, "
                             f"unexpected {sorted(set(got) - set(own))[:5]}")
        for k, v in own.items():
            if tuple(v.shape) != tuple(got[k].shape):
                raise ValueError(f"draft state {k!r}: shape {tuple(got[k].shape)}, expected {tuple(v.shape)}")
        if state["draft"].get("kind", self.kind) != self.kind:
            raise ValueError(f"draft state is for a {state['draft']['kind']!r} draft, this one is {self.kind!r}")
        with self.lock, torch.no_grad():
            for k, v in got.items():
                own[k].copy_(v)
            opt = state["optimizer"]
            self.optimizer.load_state_dict({
                "state": {int(i): dict(s) for i, s in opt["state"].items()},
                "param_groups": [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g)
                                 for g in opt["param_groups"]],
            })
            d = state["draft"]
            self.version, self.steps = int(d["version"]), int(d["steps"])
