"""Whole runs colocated on one GPU (trainer and rollout engine share it; weights over CUDA
IPC): the embedded trainer and the Megatron trainer. Skipped without CUDA (and the Megatron
one without megatron-core). Not yet run on the H200: written after the session's device
time was spent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.config import resolve  # noqa: E402
from miles.driver import train  # noqa: E402
from tests.integration.conftest import read_jsonl, run_flags, task, tiny_ckpt  # noqa: E402,F401


@pytest.fixture(scope="module")
def ray_gpu():
    import os

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, num_cpus=8, num_gpus=1, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


def _colocated_run(ckpt: Path, task: dict, out: Path, **extra: object) -> None:
    cfg = resolve(run_flags(ckpt, task, out, device="cuda", actor_num_gpus_per_node=1, colocate=True,
                            mode="async", max_staleness=1, partial_rollout=True, num_rollout=4, **extra))
    assert cfg.weights.weight_transport == "auto"  # resolves to cuda_ipc when colocated on CUDA
    summary = asyncio.run(train(cfg))
    assert summary["status"] == "completed" and summary["steps"] == 4 and summary["ledger_ok"]
    rows = read_jsonl(out / "trajectories.jsonl")
    assert max(max(r["token_versions"]) for r in rows if r["token_versions"]) >= 1
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m.get("weights/fallbacks", 0) == 0 for m in metrics), "CUDA IPC failed over to the object store"


def test_embedded_trainer_colocated_run(ray_gpu, tiny_ckpt, task, tmp_path: Path) -> None:
    _colocated_run(tiny_ckpt, task, tmp_path / "embedded")


def test_megatron_trainer_colocated_run(ray_gpu, tiny_ckpt, task, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    _colocated_run(tiny_ckpt, task, tmp_path / "megatron", train_backend="megatron")
