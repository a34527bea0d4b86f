"""Rollout routing replay (R3) for the Megatron trainer: MoE routers use the experts the
rollout engine picked for the tokens that carry loss.

megatron-core ≥ 0.16 has the hook (``transformer/moe/router_replay.py``): with
``TransformerConfig.moe_enable_routing_replay`` every ``TopKRouter`` owns a ``RouterReplay``
whose ``get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)`` replaces
the top-k selection, and whose replay actions take indices for *every* token. The trainer
knows recorded experts only where response tokens were sampled (``Trajectory.routed_experts``
rows, at positions P + j − 1); prompt positions must route as the router itself decides
(as the engine did when it prefilled them). So each of *this model's* ``RouterReplay``
instances gets a small instance-level ``get_replay_topk`` (nothing global is patched, so a
reference model or a second trainer is unaffected, and Megatron's class-level instance list
is never used): the router's own top-k, with the recorded ids substituted where a token is
replayed; the combine weights are the current router's scores gathered at those ids (softmax
over them without pre-softmax, as Megatron's own replay does), so the router keeps its gradient.

Without ``RouterReplay`` (older megatron-core) ``TopKRouter.routing`` of this model's routers is
replaced per instance by ``_fallback_routing``, the same softmax top-k (no groups, no
capacity, no aux loss) with the substitution. Targets are per micro-batch: they are set in the
forward step right before the model runs, so activation recomputation in the same
micro-batch's backward sees the same targets; pipelining with recomputation is refused.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor


def has_router_replay() -> bool:
    try:
        from megatron.core.transformer.moe import router_replay  # noqa: F401
    except ImportError:
        return False
    return True


def _replay_topk(self: Any, scores: Tensor, topk: int, num_groups: int | None = None,
                 group_topk: int | None = None, default_compute_topk: Any = None) -> tuple[Tensor, Tensor]:
    target, mask = getattr(self, "miles_target", None), getattr(self, "miles_mask", None)
    if target is None:
        return self.miles_original_topk(scores, topk, num_groups, group_topk, default_compute_topk)
    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    if target.shape != own.shape:
        raise ValueError(f"replayed routing has shape {tuple(target.shape)}, the router sees {tuple(own.shape)}")
    idx = torch.where(mask[:, None], target.to(own.device), own)
    return scores.gather(1, idx), idx


def _fallback_routing(self: Any, logits: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
    target, mask = getattr(self, "miles_target", None), getattr(self, "miles_mask", None)
    if target is None:
        return self.miles_original_routing(logits, *args, **kwargs)
    cfg = self.config
    logits = logits.view(-1, cfg.num_moe_experts)
    if cfg.moe_router_pre_softmax:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        own = torch.topk(scores, cfg.moe_router_topk, dim=1).indices
        idx = torch.where(mask[:, None], target.to(own.device), own)
        probs = scores.gather(1, idx)
    else:
        own = torch.topk(logits, cfg.moe_router_topk, dim=1).indices
        idx = torch.where(mask[:, None], target.to(own.device), own)
        probs = torch.softmax(logits.gather(1, idx), dim=-1, dtype=torch.float32)
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, idx, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return routing_probs, routing_map


def _forget(replay: Any) -> None:
    """Drop an instance from Megatron's class-level list: miles addresses its own routers
    directly, and the list would otherwise grow with every model built (reference models,
    tests, restarts)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    instances = RouterReplay.global_router_replay_instances
    for i, other in enumerate(instances):
        if other is replay:
            del instances[i]
            break


class RoutingReplay:
    """The replay hooks of one model's MoE routers, in global MoE-layer order."""

    def __init__(self, gpt: Any, moe_layers: list[int], *, force_fallback: bool = False) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.hooks: list[tuple[int, Any]] = []  # (index into moe_layers, hook object)
        use_builtin = has_router_replay() and not force_fallback
        for layer in gpt.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if not isinstance(router, TopKRouter):
                continue
            global_layer = layer.layer_number - 1
            if global_layer not in moe_layers:
                raise ValueError(f"decoder layer {global_layer} has a router but is not a MoE layer of the HF config")
            replay = getattr(router, "router_replay", None) if use_builtin else None
            if replay is not None:
                _forget(replay)
                replay.miles_original_topk = replay.get_replay_topk
                replay.get_replay_topk = types.MethodType(_replay_topk, replay)
                hook = replay
            else:
                router.miles_original_routing = router.routing
                router.routing = types.MethodType(_fallback_routing, router)
                hook = router
            hook.miles_target = hook.miles_mask = None
            self.hooks.append((moe_layers.index(global_layer), hook))

    def set(self, targets: Tensor, mask: Tensor) -> None:
        """``targets`` [tokens, L_moe, k] over all MoE layers, ``mask`` [tokens] (router order)."""
        for index, hook in self.hooks:
            hook.miles_target = targets[:, index].contiguous()
            hook.miles_mask = mask

    def clear(self) -> None:
        for _, hook in self.hooks:
            hook.miles_target = hook.miles_mask = None
