"""benchmarks/low_precision_rl.py: each mode's `miles train` command parses to the engine and
trainer quantization the mode claims, fits the countdown model's shapes, and the report's
verdicts follow the figures. No training here: that is the benchmark's job."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from miles.config import ConfigError, parse_args
from miles.models import CausalLM, save_pretrained, tiny_config
from miles.validation import _quant_problems

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "low_precision_rl.py"


@pytest.fixture(scope="module")
def lp():
    spec = importlib.util.spec_from_file_location("low_precision_rl_bench", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A checkpoint of the countdown SFT model's shapes (examples/countdown/sft.py) and a prompt file."""
    root = tmp_path_factory.mktemp("lprl")
    cfg = tiny_config(hidden_size=96, intermediate_size=192, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=24, max_position_embeddings=512)
    save_pretrained(CausalLM(cfg), root / "sft")
    (root / "train.jsonl").write_text(json.dumps({"input": "1 2", "label": "3"}) + "\n")
    return {"sft": root / "sft", "train": root / "train.jsonl", "eval": root / "eval.jsonl"}


def _args(**kw) -> argparse.Namespace:
    base = dict(steps=3, prompts=2, samples=2, max_new_tokens=8, lr=1e-4, mode="sync", device="cpu",
                int4_group_size=32, miles_args="")
    return argparse.Namespace(**{**base, **kw})


def _config(lp, inputs, mode: str, tmp_path: Path, **kw):
    cmd = lp.train_command(_args(**kw), inputs, mode, 0, tmp_path / mode)
    assert cmd[1:4] == ["-m", "miles", "train"]
    return parse_args(cmd[4:])


@pytest.mark.parametrize(("mode", "engine", "trainer"), [
    ("bf16", None, None), ("rollout-fp8", "fp8", None), ("fp8", "fp8", "fp8"), ("int4-qat", "int4", "int4"),
])
def test_each_mode_quantizes_the_sides_it_claims(lp, inputs, tmp_path, mode, engine, trainer) -> None:
    cfg = _config(lp, inputs, mode, tmp_path)
    e, t = cfg.quant.engine_spec(), cfg.quant.trainer_spec()
    assert (e and e.kind, t and t.kind) == (engine, trainer)
    assert lp.served_spec(mode, 32) == e  # the evaluator's "served" column is the engine's quantization
    assert cfg.scheduler.mode == "sync" and cfg.algorithm.use_tis and cfg.engine.device == "cpu"
    assert list(_quant_problems(cfg)) == []  # group 32 and partial FP8 blocks fit hidden 96 / MLP 192


def test_a_group_that_does_not_divide_is_refused_before_the_run(lp, inputs, tmp_path) -> None:
    with pytest.raises(ConfigError, match="--int4-group-size 128 does not divide the input dimension 96"):
        _config(lp, inputs, "int4-qat", tmp_path, int4_group_size=128)


def _metrics(run_dir: Path, k3: float, reward: float) -> None:
    (run_dir / "run").mkdir(parents=True)
    rows = [{"step": s, "train/mismatch_kl_k1": k3, "train/mismatch_kl_k3": k3, "train/tis_ratio_mean": 1.0,
             "train/tis_ratio_max": 1.0 + s / 10, "train/tis_clip_frac": 0.0, "train/tis_ess": 1.0,
             "rollout/reward_mean": reward + s / 100, "perf/step_s": 1.0} for s in range(1, 7)]
    (run_dir / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_reads_the_runs_and_judges_against_bf16(lp, tmp_path) -> None:
    results = []
    ends = {("bf16", 0): 0.60, ("bf16", 1): 0.64, ("fp8", 0): 0.61, ("fp8", 1): 0.63, ("int4-qat", 0): 0.40,
            ("int4-qat", 1): 0.42}
    for (mode, seed), end in ends.items():
        d = tmp_path / f"{mode}_{seed}"
        _metrics(d, {"bf16": 1e-7, "fp8": 1e-7, "int4-qat": 4e-7}[mode], 0.5)
        m = lp.train_metrics(d)
        assert m["steps"] == 6 and m["train/tis_ratio_max_max"] == pytest.approx(1.6)
        assert m["rollout_reward_first5"] == pytest.approx(0.53) and m["rollout_reward_last5"] == pytest.approx(0.54)
        results.append({"mode": mode, "seed": seed, "end": end, "end_served": None, "process_s": 1.0, "metrics": m})
    args = _args(seeds=[0, 1], modes=["bf16", "fp8", "int4-qat"], eval_prompts=10_000, eval_samples=4)
    text = "\n".join(lp.summarize(args, results, {"bf16": 0.5}))
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")
            and line.count("|") == 11}
    assert "| +0.0000 |" in rows["fp8"] and "| yes |" in rows["fp8"]  # paired deltas +0.01, -0.01
    assert "| -0.2100 |" in rows["int4-qat"] and "| NO |" in rows["int4-qat"]
    assert "spread over seeds: 0.0400" in text and "int4-qat 4.00e-07 (4×)" in text
