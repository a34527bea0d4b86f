"""Checkpoint state of the Megatron trainer: this rank's shards, tensors and plain values only.

``trainer_state`` returns (leaves: CPU tensors or plain Python values; no pickle)::

    {"model": {megatron_param_name: tensor},          # this rank's shard, training dtype
     "optimizer": {megatron_param_name: {"main": fp32 master (mixed precision only),
                                         "exp_avg", "exp_avg_sq", "step", ...}},
     "trainer": {"version", "optimizer_steps", "consecutive_nonfinite", "skipped_steps_total"},
     "rng": {"torch", "cuda": [...], "shuffle"},
     "layout": {"tp", "pp", "ep", "etp", "cp", "dp", "tp_rank", ...}}

Each rank saves and loads its own state (``launch.RayRankGroup`` keeps one per rank); loading
checks the layout, every name and every shape before changing anything. The optimizer state
is keyed by parameter name through Megatron's optimizer wrappers (``ChainedOptimizer`` of
``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params``); the distributed (ZeRO) optimizer
shards it over data-parallel ranks in buffers, which this format does not cover yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from miles.trainers.megatron.trainer import MegatronTrainer

TRAINER_KEYS = ("version", "optimizer_steps", "consecutive_nonfinite", "skipped_steps_total")


def _flat(groups: list[list[Tensor]]) -> list[Tensor]:
    return [p for g in groups for p in g]


def param_slots(optimizer: Any) -> Iterator[tuple[Tensor, Tensor, Any]]:
    """(model param, param the torch optimizer updates, torch optimizer) for every param."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if hasattr(opt, "float16_groups"):  # mixed precision: fp32 master copies
            for model_p, main_p in zip(_flat(opt.float16_groups), _flat(opt.fp32_from_float16_groups)):
                yield model_p, main_p, inner
            for p in _flat(opt.fp32_from_fp32_groups):
                yield p, p, inner
        else:
            for group in inner.param_groups:
                for p in group["params"]:
                    yield p, p, inner


def _require_plain_optimizer(tr: MegatronTrainer) -> None:
    if tr.mcfg.use_distributed_optimizer:
        raise NotImplementedError("checkpointing with --use-distributed-optimizer is not implemented "
                                  "(its state is sharded in DDP buffers); train without it to checkpoint")


def _cpu(t: Any) -> Any:
    return t.detach().to("cpu", copy=True) if isinstance(t, Tensor) else t


def trainer_state(tr: MegatronTrainer) -> dict[str, Any]:
    _require_plain_optimizer(tr)
    names = {id(p): n for n, p in tr.gpt.named_parameters()}
    optimizer: dict[str, dict[str, Any]] = {}
    for model_p, main_p, inner in param_slots(tr.optimizer):
        entry = {k: _cpu(v) for k, v in inner.state.get(main_p, {}).items()}
        if main_p is not model_p:
            entry["main"] = _cpu(main_p)
        optimizer[names[id(model_p)]] = entry
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "shuffle": tr._shuffle.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {
        "model": {n: _cpu(p) for n, p in tr.gpt.named_parameters()},
        "optimizer": optimizer,
        "trainer": {k: int(getattr(tr, "_version" if k == "version" else k)) for k in TRAINER_KEYS},
        "rng": rng,
        "layout": dataclasses.asdict(tr.layout),
    }


def _check(tr: MegatronTrainer, state: dict[str, Any]) -> None:
    for key in ("model", "optimizer", "trainer", "rng", "layout"):
        if key not in state:
            raise ValueError(f"trainer state has no {key!r} entry")
    have = dataclasses.asdict(tr.layout)
    if dict(state["layout"]) != have:
        raise ValueError(f"trainer state was saved with layout {state['layout']}, this rank has {have}")
    own = dict(tr.gpt.named_parameters())
    got = state["model"]
    missing, extra = sorted(set(own) - set(got)), sorted(set(got) - set(own))
    if missing or extra:
        raise ValueError(f"model state mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
    for n, p in own.items():
        if tuple(got[n].shape) != tuple(p.shape):
            raise ValueError(f"model state {n!r}: shape {tuple(got[n].shape)}, expected {tuple(p.shape)}")
    unknown = sorted(set(state["optimizer"]) - set(own))
    if unknown:
        raise ValueError(f"optimizer state for unknown parameters {unknown[:5]}")
    for k in TRAINER_KEYS:
        if not isinstance(state["trainer"].get(k), int):
            raise ValueError(f"trainer state {k!r} missing or not an int")


def _place(value: Any, like: Tensor, inner: Any) -> Any:
    if not isinstance(value, Tensor):
        return value
    on_device = value.ndim > 0 or any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
    return value.to(like.device) if on_device else value.cpu()


@torch.no_grad()
def load_trainer_state(tr: MegatronTrainer, state: dict[str, Any]) -> None:
    _require_plain_optimizer(tr)
    _check(tr, state)
    names = {id(p): n for n, p in tr.gpt.named_parameters()}
    own = dict(tr.gpt.named_parameters())
    for n, p in own.items():
        p.copy_(state["model"][n])
    for model_p, main_p, inner in param_slots(tr.optimizer):
        entry = dict(state["optimizer"].get(names[id(model_p)], {}))
        main = entry.pop("main", None)
        if main_p is not model_p:
            main_p.copy_(main if main is not None else model_p.float())
        if entry:
            inner.state[main_p] = {k: _place(v, main_p, inner) for k, v in entry.items()}
        else:
            inner.state.pop(main_p, None)
    t = state["trainer"]
    tr._version, tr.optimizer_steps = t["version"], t["optimizer_steps"]
    tr.consecutive_nonfinite, tr.skipped_steps_total = t["consecutive_nonfinite"], t["skipped_steps_total"]
    torch.set_rng_state(state["rng"]["torch"])
    tr._shuffle.set_state(state["rng"]["shuffle"])
    if torch.cuda.is_available() and "cuda" in state["rng"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
