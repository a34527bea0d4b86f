"""One copy of the base weights for a colocated LoRA trainer and its engine.

A LoRA trainer's base is frozen and, on a GPU, already in the engine's dtype (bf16:
``miles.trainers.lora.cast_for_training``), with q/k/v and gate/up laid out as the engine's
fused GEMMs read them (``fuse_frozen_base``). So a colocated engine need not hold a copy of
its own: ``engine_model`` builds its ``CausalLM`` with every parameter that has the engine's
device and dtype *being* the trainer's tensor (same storage), and a private copy of the rest
(the trainer keeps the embedding, norms and biases in float32: about 1.5 GB at 32B, against the
65.5 GB of matrices shared). The engine then never writes those tensors: a LoRA update stays
unmerged (``miles.engines.lora.UnmergedAdapters``), ``--offload-rollout`` releases and restores
only its private tensors, and an update naming a shared tensor is refused.

Across processes (a trainer actor and a rollout worker on one GPU) the same map travels as
CUDA IPC handles, one per storage, opened once at the engine's start (``export_handles`` in
the trainer, ``open_handles`` in the worker), as ``miles.transports.cuda_ipc`` maps weight
buffers. Where the tensors cannot be shared (other devices, a CPU engine in another process,
MoE layers, quantized engines), ``sharing_problem`` says why and the engine keeps its own copy
and merges the adapters (``engine/lora_shared_base`` = 0).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import torch
from torch import Tensor, nn

from miles.models.config import ModelConfig
from miles.models.layers import Rotary
from miles.models.model import CausalLM
from miles.transports.base import IpcHandle


def _resolve(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def sharing_problem(config: ModelConfig, base: Mapping[str, Tensor], device: torch.device | str,
                    dtype: torch.dtype) -> str | None:
    """Why an engine on ``device`` in ``dtype`` cannot serve ``base`` shared, or None."""
    device = _resolve(device)
    if config.is_moe:
        return "MoE layers: the engine's expert dispatch has no unmerged-adapter path"
    mats = [t for n, t in base.items() if t.ndim == 2 and ".layers." in n]
    if not mats:
        return "no base matrices given"
    t = mats[0]
    if t.dtype != dtype:
        return f"the trainer's base is {t.dtype}, the engine runs {dtype}"
    if t.device != device:
        return f"the trainer's base is on {t.device}, the engine on {device}"
    return None


def engine_model(config: ModelConfig, base: Mapping[str, Tensor], device: torch.device | str,
                 dtype: torch.dtype) -> tuple[CausalLM, frozenset[str]]:
    """A ``CausalLM`` over ``base`` (HF names -> tensors): the tensors that already have
    ``device`` and ``dtype`` are used as they are (returned as the shared names), the others
    copied. Nothing of the size of the model is allocated on the way (built on meta)."""
    device = _resolve(device)
    with torch.device("meta"):
        model = CausalLM(config)
    model.rotary = Rotary(config)  # its tables are made where they are first used, not on meta
    shared: set[str] = set()
    for mod_name, module in model.named_modules():
        for leaf, p in list(module._parameters.items()):
            if p is None:
                continue
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            src = base.get(name)
            if src is None:
                raise ValueError(f"the shared base has no {name!r}")
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"the shared base's {name!r} has shape {tuple(src.shape)}, the model's is "
                                 f"{tuple(p.shape)}")
            if src.device == device and src.dtype == dtype:
                t = src.detach()
                shared.add(name)
            else:
                t = src.detach().to(device, dtype, copy=True)
            module._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    model.tie_weights()
    if config.tie_word_embeddings and "model.embed_tokens.weight" in shared:
        shared.add("lm_head.weight")
    return model, frozenset(shared)


def shared_bytes(model: nn.Module, shared: frozenset[str]) -> int:
    """Bytes of the distinct storages behind ``shared`` parameters."""
    params = model.state_dict(keep_vars=True)
    storages = {params[n].untyped_storage().data_ptr(): params[n].untyped_storage().nbytes()
                for n in shared if n in params}
    return sum(storages.values())


class SharedTensor(msgspec.Struct, frozen=True, array_like=True):
    """One base tensor as a view of an IPC-shared storage (plain data, as handles travel)."""

    name: str
    storage: int  # index into the handles list
    offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


class SharedBase(msgspec.Struct, frozen=True):
    """The trainer's frozen base for one engine process: a handle per storage, the views."""

    handles: list[IpcHandle]
    tensors: list[SharedTensor]


def export_handles(base: Mapping[str, Tensor]) -> SharedBase:
    """CUDA IPC handles to the storages behind ``base`` (one share per storage, for one
    consumer), and each tensor's place in them. The trainer keeps the tensors alive."""
    index: dict[int, int] = {}
    handles: list[IpcHandle] = []
    tensors: list[SharedTensor] = []
    for name, t in base.items():
        if not t.is_cuda:
            raise ValueError(f"export_handles: {name!r} is on {t.device}; CUDA IPC shares GPU memory only")
        key = t.untyped_storage().data_ptr()
        if key not in index:
            index[key] = len(handles)
            handles.append(IpcHandle(*t.untyped_storage()._share_cuda_()))
        tensors.append(SharedTensor(name, index[key], t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                                    str(t.dtype).removeprefix("torch.")))
    return SharedBase(handles, tensors)


def open_handles(shared: SharedBase, device: int) -> dict[str, Tensor]:
    """The base as views of the mapped storages on local ``device`` (no copy)."""
    from miles.transports.cuda_ipc import open_handle

    storages = [open_handle(h, device).untyped_storage() for h in shared.handles]
    out = {}
    for s in shared.tensors:
        dtype = getattr(torch, s.dtype)
        out[s.name] = torch.empty(0, dtype=dtype, device=f"cuda:{device}").set_(
            storages[s.storage], s.offset, s.shape, s.stride)
    return out


class BaseOffer(msgspec.Struct, frozen=True):
    """A trainer's answer to an engine process that asks for its base (``offer``)."""

    base: SharedBase | None
    gpu: str = ""  # the trainer's GPU (UUID), where ``base`` is set
    why_not: str = ""  # why there is no base to share, where it is not


def offer(backend: object) -> BaseOffer:
    """The trainer's side: IPC handles to its frozen base for one engine process, or why not."""
    if not getattr(backend, "lora", False):
        return BaseOffer(None, why_not="full-parameter training: the engine's weights change with every update")
    try:
        base = backend.shared_base()  # type: ignore[attr-defined]
    except ValueError as exc:
        return BaseOffer(None, why_not=str(exc))
    t = next(iter(base.values()))
    if not t.is_cuda:
        return BaseOffer(None, why_not=f"the trainer's base is on {t.device}: an engine in another process cannot "
                                       f"map it (CUDA IPC shares GPU memory only)")
    from miles.transports.cuda_ipc import gpu_uuid

    return BaseOffer(export_handles(base), gpu=gpu_uuid(t.device))


def open_offer(got: BaseOffer, config: ModelConfig, device: str,
               dtype: torch.dtype) -> tuple[dict[str, Tensor] | None, str]:
    """The engine process's side: the trainer's base as views on this process's copy of its GPU,
    or (None, why not); an offer not taken gives its handles' counts back."""
    why = got.why_not
    if got.base is not None:
        from miles.transports.base import TransportError
        from miles.transports.cuda_ipc import local_index, release_handle

        index = None
        if torch.device(device).type != "cuda":
            why = f"the engine runs on {device}"
        else:
            try:
                index = local_index(got.gpu)
                if _resolve(device).index != index:
                    why, index = f"the engine runs on {device}, the trainer's base is on cuda:{index}", None
            except TransportError as exc:
                why = str(exc)
        if index is not None:
            base = open_handles(got.base, index)
            why = sharing_problem(config, base, torch.device("cuda", index), dtype) or ""
            if not why:
                return base, ""
        else:
            for h in got.base.handles:
                release_handle(h)
    return None, why
