"""Whole runs with speculative rollouts and the DraftTrainer actor: the draft channel
delivers new draft versions to the workers while training goes on, spec/* and draft/*
metrics are logged per step, and the draft's state is checkpointed and resumed."""

from __future__ import annotations

import asyncio

from safetensors.torch import load_file

from miles.config import resolve
from miles.driver import train
from tests.integration.conftest import read_jsonl, run_flags


def test_run_with_online_eagle_training(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    summary = asyncio.run(train(resolve(run_flags(
        tiny_ckpt, task, tmp_path / "out", mode="async", speculative_algorithm="eagle", enable_draft_training=True,
        draft_kl_coef=0.1, speculative_num_steps=2, rollout_max_response_len=16, num_rollout=3))))
    assert summary["status"] == "completed" and summary["ledger_ok"]
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert max(m["draft/version"] for m in metrics) >= 1 and "draft/feature_loss" in metrics[-1]
    assert summary["workers"][0]["engine/spec_rounds"] > 0


def test_run_with_online_draft_training_checkpoint_and_resume(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    out, ck = tmp_path / "out", tmp_path / "ck"
    common = dict(mode="one-step-off", speculative_algorithm="draft", enable_draft_training=True,
                  draft_train_interval=1, draft_lr=1e-3, speculative_num_steps=2, rollout_max_response_len=16,
                  save=str(ck), save_interval=2, num_rollout=4)
    summary = asyncio.run(train(resolve(run_flags(tiny_ckpt, task, out, **common))))
    assert summary["status"] == "completed" and summary["ledger_ok"]
    metrics = read_jsonl(out / "metrics.jsonl")
    for key in ("draft/version", "draft/loss", "draft/trained", "draft/published"):
        assert key in metrics[-1], key
    assert max(m["draft/version"] for m in metrics) >= 1  # the DraftTrainer published
    worker = summary["workers"][0]  # (per-step spec/* come from the health pings, when they ran)
    for key in ("spec/accept_len_total", "spec/accept_rate_total", "spec/tokens_per_s_plain", "spec/alpha"):
        assert key in worker, key
    assert worker["spec/draft_version"] >= 1 and worker["rollout/draft_updates"] >= 1  # applied by a worker
    # policy versions went their own way: the 4th step's update, published at the end, may reach the
    # worker after it stopped
    assert worker["engine/version"] in (3.0, 4.0)
    step = ck / "step_000004"
    draft = load_file(str(step / "draft.safetensors"))
    assert any(k.startswith("model.") for k in draft)
    # Resume: the draft state is loaded back and training continues from it.
    summary = asyncio.run(train(resolve(run_flags(tiny_ckpt, task, tmp_path / "out2",
                                                  **dict(common, load=str(ck), num_rollout=5)))))
    assert summary["status"] == "completed" and summary["steps"] == 5
    resumed = read_jsonl(tmp_path / "out2" / "metrics.jsonl")
    assert resumed[-1]["draft/version"] > min(m["draft/version"] for m in metrics if m["step"] == 4)
