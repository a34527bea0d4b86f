"""Whole runs colocated on one GPU (trainer and rollout engine share it; weights over CUDA
IPC): the embedded trainer and the Megatron trainer. Skipped without CUDA (and the Megatron
one without megatron-core). Both passed on an H200 (benchmarks/RESULTS.md, GPU checks)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.config import resolve  # noqa: E402
from miles.driver import train  # noqa: E402
from tests.gpu.conftest import check_gpu_run  # noqa: E402
from tests.integration.conftest import run_flags  # noqa: E402


def _colocated_run(ckpt: Path, task: dict, out: Path, **extra: object) -> dict:
    cfg = resolve(run_flags(ckpt, task, out, device="cuda", actor_num_gpus_per_node=1, colocate=True,
                            mode="async", max_staleness=1, partial_rollout=True, num_rollout=4, **extra))
    assert cfg.weights.weight_transport == "auto"  # resolves to cuda_ipc when colocated on CUDA
    summary = asyncio.run(train(cfg))
    check_gpu_run(out, summary, 4, "CUDA IPC")
    return summary


def test_embedded_trainer_colocated_run(ray_gpus, tiny_ckpt, task, tmp_path: Path) -> None:
    _colocated_run(tiny_ckpt, task, tmp_path / "embedded")


def test_lora_colocated_run_serves_the_trainers_base(ray_gpus, tiny_ckpt, task, tmp_path: Path) -> None:
    """Colocated LoRA: the worker's engine maps the trainer's frozen base through CUDA IPC
    (one copy on the GPU) and applies the adapter updates unmerged."""
    out = tmp_path / "lora"
    # eager, sync, two steps (the second trains version-1 tokens): the wiring is the point here
    cfg = resolve(run_flags(tiny_ckpt, task, out, device="cuda", actor_num_gpus_per_node=1, colocate=True,
                            mode="sync", num_rollout=2, compile=False,
                            lora_rank=4, lora_alpha=8.0))
    summary = asyncio.run(train(cfg))
    check_gpu_run(out, summary, 2, "CUDA IPC")
    assert summary["workers"][0]["engine/lora_shared_base"] == 1.0


def test_megatron_trainer_colocated_run(ray_gpus, tiny_ckpt, task, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    _colocated_run(tiny_ckpt, task, tmp_path / "megatron", train_backend="megatron")
