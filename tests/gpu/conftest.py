"""GPU fixtures: a local Ray cluster with every visible GPU (one per module that asks for it),
and the checks every whole GPU run shares. The tiny checkpoint and task are the integration
tier's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import read_jsonl, task, tiny_ckpt  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def ray_gpus():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, num_cpus=8, num_gpus=torch.cuda.device_count(), log_to_driver=False,
             _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


def check_gpu_run(out: Path, summary: dict, steps: int, transport: str) -> None:
    """Completed with an exact ledger; tokens sampled by a policy version > 0 prove the
    weights reached the engine; no update fell back from ``transport`` to the object store."""
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert summary["ledger_ok"]
    rows = read_jsonl(out / "trajectories.jsonl")
    assert max(max(r["token_versions"]) for r in rows if r["token_versions"]) >= 1
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m.get("weights/fallbacks", 0) == 0 for m in metrics), f"{transport} failed over to the object store"


@pytest.fixture(autouse=True)
def _engines_compile_inline(monkeypatch):
    """Engines built in this process compile inline unless a test asks for the background child
    (``compile_warmup="background"``): the tier checks the compiled serving path from the first
    token, and does not start a compile child per engine. Whole runs (Ray actors) keep the default."""
    from miles.engines import EngineConfig

    monkeypatch.setattr(EngineConfig, "warm_in_background",
                        lambda self: self.use_compile() and self.compile_warmup == "background")
