"""WeightsConfig: how policy weights travel from the trainer to the rollout engines.

``--weight-transport``:

- ``auto`` (default): ``cuda_ipc`` when the trainer and the engines share a GPU
  (``--colocate`` with both on CUDA), ``nccl`` when both are on GPUs of their own, else
  ``object_store``. The SGLang backend always uses ``object_store`` (its server has its own
  distributed update path, driven by the adapter).
- ``object_store``: Ray's object store (host memory; works everywhere, across nodes).
- ``nccl``: torch.distributed broadcast over NCCL, trainer → every engine.
- ``gloo``: the same broadcast over gloo with host buffers (CPU runs, tests).
- ``cuda_ipc``: the engines map the trainer's GPU buffers (same GPU only).

``--weight-update-changed-only`` sends only tensors whose content changed since the last
published version (partially frozen / LoRA-style training). ``--weight-transport-timeout-s``
bounds a group rendezvous and each broadcast (a dead peer fails the transfer, which falls
back to the object store).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import msgspec
import torch

Transport = Literal["auto", "object_store", "nccl", "gloo", "cuda_ipc"]


class WeightsConfig(msgspec.Struct, kw_only=True):
    weight_transport: Transport = "auto"  # auto: CUDA IPC colocated, NCCL on separate GPUs, else the object store
    weight_update_changed_only: bool = False  # send only the tensors that changed (frozen or LoRA-style training)
    weight_transport_timeout_s: float = 300.0


def _on_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def resolve_transport(cfg: Any) -> str:
    """The concrete transport of a run: ``object_store``, ``nccl``, ``gloo`` or ``cuda_ipc``."""
    choice = cfg.weights.weight_transport
    if choice != "auto":
        return choice
    if cfg.run.rollout_backend != "embedded":
        return "object_store"
    if _on_cuda(cfg.trainer.device) and _on_cuda(cfg.engine.device):
        return "cuda_ipc" if cfg.run.colocate else "nccl"
    return "object_store"


def transport_problems(cfg: Any) -> Iterator[str]:
    """Configuration errors, one sentence each (``miles.validation`` collects them)."""
    w = cfg.weights
    if w.weight_transport_timeout_s <= 0:
        yield "--weight-transport-timeout-s must be > 0"
    choice = w.weight_transport
    if choice in ("nccl", "gloo", "cuda_ipc") and cfg.run.rollout_backend != "embedded":
        yield (f"--weight-transport {choice} delivers into embedded engines; the sglang backend "
               "uses object_store (its adapter sends weights to the server itself)")
    gpus = _on_cuda(cfg.trainer.device) and _on_cuda(cfg.engine.device)
    if choice in ("nccl", "cuda_ipc") and not gpus:
        yield (f"--weight-transport {choice} needs the trainer and the engines on CUDA "
               f"(--device cuda for both); got trainer {cfg.trainer.device!r}, engine {cfg.engine.device!r}")
    if choice == "cuda_ipc" and not cfg.run.colocate:
        yield "--weight-transport cuda_ipc needs the trainer and the engines on one GPU: add --colocate"
