"""Load HF weights into this rank's Megatron shards, and export full HF-named tensors.

``load_hf`` fills every parameter of this rank's ``GPTModel`` from HF tensors (a checkpoint
directory through ``HFReader``, or any ``name → tensor`` mapping): it keeps the parameters
of its pipeline stage and expert-parallel rank and cuts its tensor-parallel shard
(``convert.hf_to_shard``). Every parameter must be filled and every shape must match.

``export_hf`` is collective over the model-parallel groups (every rank calls it and gets
the same full tensors, in the same order): tensor-parallel shards are all-gathered and
joined (``convert.shards_to_hf``), experts are all-gathered over expert-parallel ranks,
and a pipeline stage broadcasts what it owns to the other stages. With one rank it is a
pure conversion.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.models import CheckpointError, ModelConfig
from miles.trainers.megatron.convert import (
    REPLICATED,
    Naming,
    ParamSpec,
    hf_shapes,
    hf_to_shard,
    param_specs,
    shards_to_hf,
)
from miles.trainers.megatron.distributed import Layout, group_size


class HFReader:
    """``name → tensor`` over a local HF checkpoint's safetensors, opened lazily."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            files = {name: self.path / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            files = {}
            for f in sorted(self.path.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as fh:
                    files.update({name: f for name in fh.keys()})
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        self.files = files
        self._open: dict[Path, Any] = {}

    def __call__(self, name: str) -> Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        f = self.files[name]
        if f not in self._open:
            self._open[f] = safe_open(str(f), framework="pt")
        return self._open[f].get_tensor(name)


def mapping_getter(state: Mapping[str, Tensor]) -> Callable[[str], Tensor]:
    def get(name: str) -> Tensor:
        if name not in state:
            raise CheckpointError(f"tensor {name!r} is missing")
        return state[name]

    return get


@dataclass(frozen=True)
class Ownership:
    """Which layers and experts this rank's model holds."""

    layer_offset: int
    num_layers: int
    expert_offset: int
    num_local_experts: int
    first_stage: bool
    last_stage: bool

    def owns(self, spec: ParamSpec) -> bool:
        if spec.layer is None:
            return self.first_stage if spec.name.startswith("embedding.") else self.last_stage
        if not self.layer_offset <= spec.layer < self.layer_offset + self.num_layers:
            return False
        return spec.expert is None or self.expert_offset <= spec.expert < self.expert_offset + self.num_local_experts


def ownership(gpt: Any, model: ModelConfig, layout: Layout) -> Ownership:
    layers = list(gpt.decoder.layers)
    offset = layers[0].layer_number - 1 if layers else 0  # layer_number is global and 1-based
    local_experts = model.num_experts // layout.ep if model.is_moe else 0
    return Ownership(offset, len(layers), layout.ep_rank * local_experts, local_experts,
                     bool(gpt.pre_process), bool(gpt.post_process))


def _tp(spec: ParamSpec, layout: Layout) -> tuple[int, int]:
    return (layout.etp, layout.etp_rank) if spec.expert is not None else (layout.tp, layout.tp_rank)


@torch.no_grad()
def load_hf(gpt: Any, model: ModelConfig, get: Callable[[str], Tensor], layout: Layout, naming: Naming,
            padded_vocab: int) -> None:
    """Fill every parameter of ``gpt`` (this rank's stage / shard) from HF tensors."""
    params = dict(gpt.named_parameters())
    own = ownership(gpt, model, layout)
    plan: list[tuple[str, Tensor]] = []
    for spec in param_specs(model, naming):
        if not own.owns(spec):
            continue
        local = spec.local_name(own.layer_offset, own.expert_offset)
        if local not in params:
            raise CheckpointError(f"Megatron model has no parameter {local!r} (for {spec.hf})")
        tp_size, tp_rank = _tp(spec, layout)
        plan.append((local, hf_to_shard(spec, get, model, tp_size=tp_size, tp_rank=tp_rank,
                                        padded_vocab=padded_vocab)))
    if model.tie_word_embeddings and own.last_stage and not own.first_stage and "output_layer.weight" in params:
        embed = ParamSpec("output_layer.weight", ("model.embed_tokens.weight",), "vocab")
        plan.append(("output_layer.weight", hf_to_shard(embed, get, model, tp_size=layout.tp,
                                                        tp_rank=layout.tp_rank, padded_vocab=padded_vocab)))
    loaded = {name for name, _ in plan}
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"no HF tensor maps to Megatron parameters {missing[:5]}")
    for name, t in plan:  # check every shape before writing anything
        if tuple(t.shape) != tuple(params[name].shape):
            raise CheckpointError(f"{name}: HF gives shape {tuple(t.shape)}, the model has {tuple(params[name].shape)}")
    for name, t in plan:
        params[name].copy_(t.to(device=params[name].device, dtype=params[name].dtype))


# ---- export ---------------------------------------------------------------------------------


def _gather(t: Tensor, group: Any) -> list[Tensor]:
    if group_size(group) == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


@dataclass
class _Unit:
    """Some HF tensors produced together on one pipeline stage."""

    stage: int
    specs: list[ParamSpec]  # for experts: every expert of one local index, all EP ranks


def _stage_of(layer: int | None, name: str, ranges: list[tuple[int, int]]) -> int:
    if layer is None:
        return 0 if name.startswith("embedding.") else len(ranges) - 1
    for stage, (offset, count) in enumerate(ranges):
        if offset <= layer < offset + count:
            return stage
    raise ValueError(f"layer {layer} is on no pipeline stage ({ranges})")


def _units(model: ModelConfig, naming: Naming, ranges: list[tuple[int, int]], ep: int) -> list[_Unit]:
    units: list[_Unit] = []
    local_experts = model.num_experts // ep if model.is_moe else 0
    for spec in param_specs(model, naming):
        stage = _stage_of(spec.layer, spec.name, ranges)
        if spec.expert is None:
            units.append(_Unit(stage, [spec]))
        elif spec.expert < local_experts:  # one unit per (template, local index) over EP ranks
            units.append(_Unit(stage, [ParamSpec(spec.template, _expert_hf(spec, spec.expert + r * local_experts),
                                                 spec.kind, spec.layer, spec.expert + r * local_experts)
                                       for r in range(ep)]))
    return units


def _expert_hf(spec: ParamSpec, expert: int) -> tuple[str, ...]:
    return tuple(n.replace(f".experts.{spec.expert}.", f".experts.{expert}.") for n in spec.hf)


def _produce(unit: _Unit, params: dict[str, Tensor], own: Ownership, model: ModelConfig, layout: Layout,
             grp: dict[str, Any], dtype: torch.dtype) -> list[tuple[str, Tensor]]:
    out: list[tuple[str, Tensor]] = []
    first = unit.specs[0]
    # an expert unit's first spec carries the local expert index (expert-parallel rank 0's id)
    local = params[first.local_name(own.layer_offset, 0)].detach()
    tp_group = grp.get("etp" if first.expert is not None else "tp")
    shards = [local] if first.kind == REPLICATED else _gather(local, tp_group)
    if first.expert is None:
        return [(n, t.to(dtype).contiguous()) for n, t in shards_to_hf(first, shards, model)]
    per_rank = _gather(torch.stack(shards), grp.get("ep"))  # [ep] × [etp, ...]
    for spec, stacked in zip(unit.specs, per_rank):
        out += [(n, t.to(dtype).contiguous()) for n, t in shards_to_hf(spec, list(stacked.unbind(0)), model)]
    return out


def export_hf(gpt: Any, model: ModelConfig, layout: Layout, naming: Naming, *,
              dtype: torch.dtype | None = None, grp: dict[str, Any] | None = None) -> Iterator[tuple[str, Tensor]]:
    """Every HF tensor of the model, full (not sharded) and contiguous, on every rank; collective.
    Without ``dtype`` a replicated tensor may share storage with the live parameter: consume
    the tensors before the next train step (as with the embedded trainer)."""
    params = {n: p for n, p in gpt.named_parameters()}
    own = ownership(gpt, model, layout)
    dtype = dtype or next(iter(params.values())).dtype
    device = next(iter(params.values())).device
    grp = grp or {}
    ranges = [(own.layer_offset, own.num_layers)]
    if layout.pp > 1:
        gathered: list[Any] = [None] * layout.pp
        dist.all_gather_object(gathered, ranges[0], group=grp["pp"])
        ranges = [tuple(r) for r in gathered]
    for unit in _units(model, naming, ranges, layout.ep):
        if unit.stage == layout.pp_rank:
            named = _produce(unit, params, own, model, layout, grp, dtype)
        else:
            named = [(n, torch.empty(s, dtype=dtype, device=device))
                     for spec in unit.specs for n, s in zip(spec.hf, hf_shapes(spec, model))]
        if layout.pp > 1:
            src = dist.get_global_rank(grp["pp"], unit.stage)
            for _, t in named:
                dist.broadcast(t, src=src, group=grp["pp"])
        yield from named
