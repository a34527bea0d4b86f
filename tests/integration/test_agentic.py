"""Agentic runs end to end on the session's local Ray cluster (conftest.py), tiny model, CPU.

- an episode spans several policy versions: per-token versions and loss masks checked
  from ``--dump-trajectories`` (model tokens: loss iff inside the staleness bound under
  ``--stale-policy mask``; environment tokens: never, exactly the template's tokens);
- environments that raise, hang or return garbage: those episodes are FAILED with their
  reason and counted, the run completes, the ledger sums.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.cli import main
from miles.envs import TurnTemplate
from miles.models import CausalLM, build_tiny_tokenizer, save_pretrained, tiny_config

ROOT = Path(__file__).resolve().parents[2]
ENVS = Path(__file__).with_name("agentic_envs.py")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(CausalLM(tiny_config()), path, tokenizer=build_tiny_tokenizer())
    return path


def _data(path: Path, labels: list[str]) -> Path:
    path.write_text("".join(json.dumps({"input": f"task {i}", "label": lab}) + "\n" for i, lab in enumerate(labels)))
    return path


def _train(tmp_path: Path, checkpoint: Path, labels: list[str], *flags: str) -> dict:
    out = tmp_path / "out"
    argv = ["train", "--hf-checkpoint", str(checkpoint), "--prompt-data", str(_data(tmp_path / "d.jsonl", labels)),
            "--output-dir", str(out), "--no-progress", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--lr", "1e-4", "--max-turn-tokens", "4", "--max-turns", "200", "--rollout-max-response-len", "600", *flags]
    assert main(argv) == 0
    return json.loads((out / "summary.json").read_text())


def test_episodes_span_policy_versions(ray_cluster, checkpoint, tmp_path) -> None:
    eta = 3
    summary = _train(tmp_path, checkpoint, ["long"] + ["short"] * 15,
                     "--env-path", f"{ENVS}:LongShortEnv", "--num-rollout", "14", "--mode", "async",
                     "--max-staleness", str(eta), "--partial-rollout", "--stale-policy", "mask",
                     "--dump-trajectories")
    assert summary["status"] == "completed" and summary["ledger_ok"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()]
    tok = build_tiny_tokenizer()
    chat = TurnTemplate("chat", tokenizer=tok)
    spans = []
    for row in rows:
        versions, mask, kinds = row["versions"], row["loss_mask"], []
        for start, end, kind in row["segments"]:
            kinds += [kind] * (end - start)
        assert len(kinds) == len(versions) == len(mask) == len(row["response_tokens"])
        assert versions == sorted(versions) and max(versions) <= row["trainer_version"]
        cutoff = row["trainer_version"] - eta
        for v, m, k, lp in zip(versions, mask, kinds, row["logprobs"]):
            if k == "env":
                assert m == 0 and lp == 0.0
            else:  # loss iff inside the staleness bound (the rest is masked, not dropped)
                assert m == int(v >= cutoff)
        turns = row["metadata"]["env_episode"]["turns"]
        for n, (start, end, obs_end, _, _) in enumerate(turns, start=1):
            if obs_end > end:  # the observation is exactly the template's tokens, once
                assert row["response_tokens"][end:obs_end] == tok.encode(chat.observation_text(f"turn {n}"))
        spans.append(len({v for v, k in zip(versions, kinds) if k == "model"}))
    long_rows = [r for r in rows if r["label"] == "long"]
    assert long_rows and all(r["status"] == "completed" for r in long_rows)
    assert max(spans) >= 3, spans


def test_broken_envs_fail_with_reasons_and_the_run_goes_on(ray_cluster, checkpoint, tmp_path) -> None:
    labels = ["raise", "ok", "hang", "ok", "garbage", "ok", "hang_async", "ok"]
    summary = _train(tmp_path, checkpoint, labels, "--env-path", f"{ENVS}:FlakyEnv", "--num-rollout", "3",
                     "--turn-timeout-s", "0.5", "--mode", "async", "--max-staleness", "2")
    assert summary["status"] == "completed" and summary["ledger_ok"]
    ledger = summary["ledger"]
    assert ledger["dropped"].get("failed", 0) >= 8  # four bad groups of two, at least
    worker = summary["workers"][0]
    for kind in ("env_error", "env_timeout", "env_invalid"):
        assert worker.get(f"env/failed/{kind}", 0) >= 2, (kind, worker)
    assert worker["env/failed/env_timeout"] >= 4  # sync and async hangs
    assert worker["rollout/failed"] >= 8 and worker["env/episodes_completed"] >= 6


def test_examples_run_in_smoke_mode(ray_cluster, tmp_path) -> None:
    from miles.utils.loading import load_function

    load_function(f"{ROOT}/examples/agentic/number_guess.py:prepare")(str(tmp_path / "guess"))
    load_function(f"{ROOT}/examples/agentic/calculator.py:prepare")(str(tmp_path / "calc"))
    g = tmp_path / "guess"
    argv = ["train", "--config", str(ROOT / "examples/agentic/number_guess.yaml"), "--hf-checkpoint", str(g / "ckpt"),
            "--prompt-data", str(g / "train.jsonl"), "--eval-prompt-data", str(g / "eval.jsonl"),
            "--env-path", f"{ROOT}/examples/agentic/number_guess.py:NumberGuessEnv",
            "--output-dir", str(g / "out"), "--num-rollout", "2", "--eval-interval", "0", "--no-progress",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4"]
    assert main(argv) == 0
    argv = ["train", "--hf-checkpoint", str(g / "ckpt"), "--prompt-data", str(tmp_path / "calc" / "train.jsonl"),
            "--apply-chat-template", "--env-path", f"{ROOT}/examples/agentic/calculator.py:CalculatorEnv",
            "--env-observation-role", "tool", "--max-turns", "3", "--max-turn-tokens", "32",
            "--rollout-max-response-len", "300", "--max-prompt-len", "700", "--num-rollout", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--output-dir", str(tmp_path / "calc" / "out"),
            "--no-progress"]
    assert main(argv) == 0
    for out in (g / "out", tmp_path / "calc" / "out"):
        assert json.loads((out / "summary.json").read_text())["ledger_ok"]
