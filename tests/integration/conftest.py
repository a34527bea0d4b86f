"""Integration fixtures: one local Ray cluster per test session, a tiny checkpoint, a task.

Ray starts once (≈3 s) and every run in the session shares it; the driver kills its own
actors at shutdown, so runs do not leak into each other. Its workers import from the
repository root (the tests' agents and environments, the examples), which the cluster puts
on their PYTHONPATH.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), old]))  # inherited by Ray's workers
    # address "local": a cluster of its own, even where another Ray instance runs on the machine
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    from miles.models import CausalLM, build_tiny_tokenizer, save_pretrained, tiny_config

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt")
    model = CausalLM(tiny_config())
    model.reset_parameters()
    save_pretrained(model, path, tokenizer=build_tiny_tokenizer())
    return path


@pytest.fixture(scope="session")
def task(tmp_path_factory) -> dict[str, str]:
    """Prompts "say N:" with label N; reward 1 when the response contains N."""
    root = tmp_path_factory.mktemp("task")
    data = root / "data.jsonl"
    with open(data, "w") as fh:
        for i in range(200):
            fh.write(json.dumps({"input": f"say {i % 10}:", "label": str(i % 10)}) + "\n")
    rm = root / "rm.py"
    rm.write_text("def reward(sample):\n    return float(sample.label in sample.response)\n")
    return {"data": str(data), "rm": f"{rm}:reward", "root": str(root)}


def run_flags(ckpt: Path, task: dict[str, str], out: Path, **extra: object) -> dict[str, object]:
    """Flat config values for a small, fast run; ``extra`` overrides (flag names with '_')."""
    flags: dict[str, object] = {
        "hf_checkpoint": str(ckpt),
        "prompt_data": task["data"],
        "custom_rm_path": task["rm"],
        "output_dir": str(out),
        "rollout_batch_size": 4,
        "n_samples_per_prompt": 4,
        "num_rollout": 4,
        "rollout_max_response_len": 24,
        "lr": 1e-4,
        "progress": False,
        "dump_trajectories": True,
        "max_batch_size": 32,
    }
    flags.update(extra)
    return flags


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]
