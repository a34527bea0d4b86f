"""The examples in smoke mode, plus the contracts they rely on.

- the countdown task: answers, slips, the held-out split, the long tail it promises;
- its reward function, loaded the way the runtime loads it (``--custom-rm-path`` file form);
- its config.yaml, resolved by miles' own config loader (async, η = 2, partial rollouts);
- the SFT cache (same arguments → reuse; different → retrain);
- ``examples/countdown/run.sh --smoke`` end to end: data, SFT, eval, RL on a local Ray
  cluster, eval of the saved checkpoint, plot, report — a tiny model and 2 RL steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest

from miles.config import load_yaml, resolve
from miles.models import CausalLM, save_pretrained, tiny_config
from miles.utils.loading import load_function

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "countdown"


def _module(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"countdown_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


task = _module("task")


def _sample(response: str, label: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(prompt="", response=response, label=label, metadata={})


def test_reward_scores_exact_countdowns_only() -> None:
    reward = load_function(f"{EXAMPLE / 'reward.py'}:reward")
    label = task.answer(305).strip()
    assert reward(_sample(task.answer(305), label)) == 1.0
    assert reward(_sample(task.answer(305).strip() + "\n", label)) == 1.0
    assert reward(_sample(" 305 304 303 302 301", label)) == 0.0  # stopped early
    assert reward(_sample(" 305 304 302 301 300", label)) == 0.0  # skipped one
    assert reward(_sample(task.answer(305) + " 299", label)) == 0.0  # went past
    assert reward(_sample("", label)) == 0.0


def test_answers_and_slips() -> None:
    assert task.prompt(412) == "count down from 412 to 400:"
    assert task.answer(402) == " 402 401 400"
    assert task.answer(700) == " 700"
    rng = random.Random(0)
    assert all(task.noisy_answer(n, rng, 0.0) == task.answer(n) for n in (100, 157, 999))
    slipped = [task.noisy_answer(n, rng, 1.0) for n in (150, 260, 399)]
    assert all(s != task.answer(n) for s, n in zip(slipped, (150, 260, 399)))
    # a slipped countdown still ends at (or stops before passing) the round hundred
    assert all(int(s.split()[-1]) % 100 in (0, 1) for s in slipped)


def test_held_out_split_and_long_tail() -> None:
    evaluation = task.eval_starts(40)
    train = task.train_starts(2000, seed=0)
    assert len(set(evaluation)) == len(evaluation)
    assert all(task.held_out(n) for n in evaluation)
    assert not set(evaluation) & set(train)
    # every distance keeps training starts: one of its nine hundreds is held out
    assert all(sum(task.held_out(100 * h + m) for h in range(1, 10)) == 1 for m in range(task.MAX_DISTANCE + 1))
    lengths = sorted(len(task.answer(n)) for n in train)
    median, longest = lengths[len(lengths) // 2], lengths[-1]
    assert longest >= 10 * median  # most answers short, a few many times longer
    assert statistics.fmean(lengths) > 2 * median


def test_data_files_are_slime_jsonl(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE / "task.py"), "--out-dir", str(tmp_path), "--num-train", "50", "--num-eval", "5"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 50 and len(held) == 5
    for row in rows + held:
        n = row["metadata"]["start"]
        assert row["input"] == task.prompt(n) and row["label"] == task.answer(n).strip()
    assert not {r["input"] for r in rows} & {r["input"] for r in held}


def test_config_resolves_with_async_defaults(tmp_path: Path) -> None:
    values = load_yaml(EXAMPLE / "config.yaml")
    ckpt = tmp_path / "ckpt"
    save_pretrained(CausalLM(tiny_config()), ckpt)  # validation reads the checkpoint's headers
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "x", "label": "y"}\n')
    values.update(hf_checkpoint=str(ckpt), prompt_data=str(data), eval_prompt_data=str(data),
                  custom_rm_path=str(EXAMPLE / "reward.py") + ":reward")
    cfg = resolve(values)
    assert cfg.scheduler.mode == "async" and cfg.scheduler.max_staleness == 2
    assert cfg.rollout.partial_rollout
    assert cfg.run.eval_interval > 0 and cfg.data.n_samples_per_eval_prompt > 1
    # the longest answer (400 bytes + eos) fits the response budget
    assert cfg.rollout.rollout_max_response_len > len(task.answer(99 + 100 * 9))


def test_sft_is_cached_by_its_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sft = _module("sft")
    data = tmp_path / "train.jsonl"
    task.write_jsonl(data, task.train_starts(16, seed=1))
    args = ["--data", str(data), "--out", str(tmp_path / "sft"), "--steps", "2", "--hidden-size", "16",
            "--num-layers", "1", "--log-every", "1"]
    sft.main(args)
    weights = tmp_path / "sft" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    sft.main(args)
    assert "reusing" in capsys.readouterr().out
    assert weights.stat().st_mtime_ns == stamp
    sft.main(args[:-2] + ["--log-every", "2", "--seed", "3"])  # a different recipe retrains
    assert weights.stat().st_mtime_ns != stamp
    stamp = weights.stat().st_mtime_ns
    task.write_jsonl(data, task.train_starts(16, seed=2))  # so does different data
    sft.main(args[:-2] + ["--log-every", "2", "--seed", "3"])
    assert weights.stat().st_mtime_ns != stamp
    stamp = weights.stat().st_mtime_ns
    copy = tmp_path / "elsewhere" / "train.jsonl"  # the same data at another path (another machine): reused
    copy.parent.mkdir()
    copy.write_bytes(data.read_bytes())
    capsys.readouterr()
    sft.main(["--data", str(copy), *args[2:-2], "--log-every", "2", "--seed", "3"])
    assert "reusing" in capsys.readouterr().out and weights.stat().st_mtime_ns == stamp
    with pytest.raises(SystemExit, match="not found"):
        sft.main(["--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x")])


def test_countdown_example_smoke(tmp_path: Path) -> None:
    out = tmp_path / "countdown"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run(["bash", str(EXAMPLE / "run.sh"), "--smoke", "--no-progress"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(0.0 <= s["rollout/reward_mean"] <= 1.0 for s in steps)
    summary = json.loads((out / "rl" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["ledger_ok"]
    for name in ("eval_before.json", "eval_after.json"):
        figures = json.loads((out / name).read_text())
        assert 0.0 <= figures["reward_mean"] <= 1.0 and "pass@2" in figures
    assert (out / "rl" / "curves.png").stat().st_size > 0
    assert "after RL" in proc.stdout and "timings:" in proc.stdout
