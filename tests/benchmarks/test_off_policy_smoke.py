"""Smoke tests of benchmarks/off_policy.py: the staleness/mismatch loop runs and is wired as
it claims (versions, noise, KLs, outputs). No assertions on learning — that is the
benchmark's job, not a unit test's."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "off_policy.py"


@pytest.fixture(scope="module")
def op():
    spec = importlib.util.spec_from_file_location("off_policy_bench", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tiny(op, **kw):
    base = dict(steps=4, groups_per_step=2, group_size=2, response_len=4, eval_prompts=4, eval_every=2,
                last_k=2, seeds=1)
    return op.OffPolicyConfig(**{**base, **kw})


def test_reward_is_fraction_of_class_tokens(op):
    assert op.reward_of([2, 9], [1, 5, 2, 13], num_classes=4) == 0.75  # class 9 % 4 = 1
    assert op.reward_of([2, 8], [1, 5], num_classes=4) == 0.0
    assert op.reward_of([2, 8], [], num_classes=4) == 0.0


def test_perturbation_is_seeded_and_zero_std_is_identity(op):
    w = {"a": torch.randn(3, 4), "b": torch.ones(5)}
    same = dict(op.perturbed(w, 0.0, seed=1))
    assert all(torch.equal(same[k], w[k]) for k in w)
    one, two, other = (dict(op.perturbed(w, 0.2, seed=s)) for s in (1, 1, 2))
    assert all(torch.equal(one[k], two[k]) for k in w)
    assert not torch.equal(one["a"], other["a"])
    assert not torch.equal(one["b"], w["b"])


@pytest.mark.parametrize("correction", ["none", "tis", "mis", "decoupled", "decoupled-loglinear"])
def test_a_run_trains_on_stale_perturbed_batches(op, correction):
    cfg, eta = tiny(op), 2
    run = op.Run(cfg, eta, correction, seed=0, mismatch_std=0.2)
    seen: list[tuple[int, set[int]]] = []
    train_step = run.trainer.train_step

    def spy(groups):
        seen.append((run.trainer.version, {v for g in groups for t in g for v in t.versions}))
        return train_step(groups)

    run.trainer.train_step = spy
    result = asyncio.run(run.run())
    assert seen == [(v, {max(0, v - eta)}) for v in range(cfg.steps)]
    assert result.eval_steps == [0, 2, 4]
    assert all(0.0 <= r <= 1.0 for r in result.eval_reward + result.train_reward)
    assert len(result.train_reward) == cfg.steps
    assert result.metrics["kl_mismatch"] > 1e-6  # the deliberate mismatch is there
    assert result.metrics["kl_offpolicy"] > 1e-6
    assert all(math.isfinite(v) for v in result.metrics.values())


def test_no_noise_means_no_mismatch(op):
    result = asyncio.run(op.Run(tiny(op), 0, "none", seed=0, mismatch_std=0.0).run())
    assert result.metrics["kl_mismatch"] < 1e-6


def test_main_writes_plot_and_results(op, tmp_path):
    results, png = tmp_path / "RESULTS.md", tmp_path / "plot.png"
    threads = torch.get_num_threads()
    try:
        op.main(["--steps", "2", "--etas", "0", "1", "--seeds", "1", "--corrections", "none", "tis",
                 "--groups-per-step", "2", "--group-size", "2", "--response-len", "4", "--eval-prompts", "4",
                 "--eval-every", "1", "--last-k", "1", "--results", str(results), "--plot", str(png)])
    finally:
        torch.set_num_threads(threads)
    text = results.read_text()
    assert "## off_policy" in text and "| 1 | tis |" in text and "Goal" in text
    assert png.stat().st_size > 0


def test_bad_flags_are_rejected(op):
    with pytest.raises(SystemExit):
        op.parse(["--corrections", "nope"])


@pytest.mark.parametrize("argv", [["--etas"], ["--seeds", "0"], ["--num-classes", "40"], ["--lr", "-1"],
                                  ["--advantage-estimator", "nope"], ["--etas", "-1"]])
def test_bad_config_is_a_clear_cli_error(op, argv, capsys):
    with pytest.raises(SystemExit):
        op.parse(argv)
    assert "error" in capsys.readouterr().err
