"""Weights export and checkpoint state of the embedded trainer.

``trainer_state`` returns nested dicts whose leaves are CPU tensors (copies, safe to write
while training goes on) or plain Python values (int, float, bool, None, str, lists):

    {"model": {hf_name: tensor},
     "optimizer": {"state": {"<param index>": {"step", "exp_avg", "exp_avg_sq"}},
                   "param_groups": [{"lr", "betas", ..., "params": [indices]}]},
     "trainer": {"version", "optimizer_steps", "consecutive_nonfinite", "skipped_steps_total"},
     "rng": {"torch": uint8 tensor, "shuffle": uint8 tensor, "cuda": [uint8 tensors]}}

so a checkpoint writer can store the tensors with safetensors and the rest as JSON.
``load_trainer_state`` checks every name and shape before changing anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from miles.trainers.embedded import EmbeddedTrainer

TRAINER_KEYS = ("version", "optimizer_steps", "consecutive_nonfinite", "skipped_steps_total")


def _full(t: Tensor) -> Tensor:
    # FSDP2 parameters are DTensors: every rank gathers the full tensor (tests/unit/trainers/test_fsdp.py).
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def named_weights(model: nn.Module, *, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(HF name, detached contiguous tensor) for every weight; a tied LM head is skipped
    (it is ``model.embed_tokens.weight``). Without ``dtype`` the tensors share storage with
    the live parameters: consume them before the next train step."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        t = _full(t).detach()
        if dtype is not None:
            t = t.to(dtype)
        yield name, t.contiguous()


def _cpu(t: Any) -> Any:
    return _full(t).detach().to("cpu", copy=True) if isinstance(t, Tensor) else t


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _model_state(tr: EmbeddedTrainer) -> dict[str, Tensor]:
    # A LoRA trainer's base weights are frozen and come from --hf-checkpoint: only the adapters are state.
    if getattr(tr, "lora", False):
        from miles.trainers.lora import adapter_state

        return adapter_state(tr.model)
    return tr.model.state_dict()


def trainer_state(tr: EmbeddedTrainer) -> dict[str, Any]:
    opt = tr.optimizer.state_dict()
    state = {
        "model": {k: _cpu(v) for k, v in _model_state(tr).items()},
        "optimizer": {
            "state": {str(i): {k: _cpu(v) for k, v in s.items()} for i, s in opt["state"].items()},
            "param_groups": [{k: _plain(v) for k, v in g.items()} for g in opt["param_groups"]],
        },
        "trainer": {k: int(getattr(tr, k if k != "version" else "_version")) for k in TRAINER_KEYS},
        "rng": {"torch": torch.get_rng_state(), "shuffle": tr._shuffle.get_state()},
    }
    if torch.cuda.is_available():
        state["rng"]["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _check(tr: EmbeddedTrainer, state: dict[str, Any]) -> None:
    for key in ("model", "optimizer", "trainer", "rng"):
        if key not in state:
            raise ValueError(f"trainer state has no {key!r} entry")
    own = _model_state(tr)
    got = state["model"]
    missing, extra = sorted(set(own) - set(got)), sorted(set(got) - set(own))
    if missing or extra:
        raise ValueError(f"model state mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, v in own.items():
        if tuple(_full(v).shape) != tuple(got[k].shape):
            raise ValueError(f"model state {k!r}: shape {tuple(got[k].shape)}, expected {tuple(v.shape)}")
    groups = state["optimizer"].get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in tr.optimizer.param_groups]:
        raise ValueError("optimizer state has a different parameter layout than this trainer")
    for k in TRAINER_KEYS:
        if not isinstance(state["trainer"].get(k), int):
            raise ValueError(f"trainer state {k!r} missing or not an int")


def load_trainer_state(tr: EmbeddedTrainer, state: dict[str, Any]) -> None:
    if tr.sharded:
        raise NotImplementedError("loading a checkpoint into an FSDP-sharded trainer is not implemented yet")
    _check(tr, state)
    with torch.no_grad():
        own = _model_state(tr)
        for k, v in state["model"].items():
            own[k].copy_(v)  # in place: keeps parameter identity (optimizer, FSDP)
    opt = state["optimizer"]
    tr.optimizer.load_state_dict({
        "state": {int(i): dict(s) for i, s in opt["state"].items()},
        "param_groups": [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in opt["param_groups"]],
    })
    t = state["trainer"]
    tr._version = t["version"]
    tr.optimizer_steps = t["optimizer_steps"]
    tr.consecutive_nonfinite = t["consecutive_nonfinite"]
    tr.skipped_steps_total = t["skipped_steps_total"]
    torch.set_rng_state(state["rng"]["torch"])
    tr._shuffle.set_state(state["rng"]["shuffle"])
    if torch.cuda.is_available() and "cuda" in state["rng"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
