"""benchmarks/async_vs_sync.py --sweep: the sweep's configs are the ones AReaL's table needs and
resolve to valid runs, its table's cells follow the figures (synthetic results, then a tiny
CPU run of two configs, one of them unbounded). No throughput or reward claims: that is the
benchmark's job."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.async_vs_sync_report import sweep_table
from miles.config import default_config
from miles.scheduler import UNBOUNDED

ROOT = Path(__file__).resolve().parents[2]
PATH = ROOT / "benchmarks" / "async_vs_sync.py"


@pytest.fixture(scope="module")
def avs():
    spec = importlib.util.spec_from_file_location("async_vs_sync_bench", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def cells(lines: list[str]) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell (the second too where the first repeats)."""
    out: dict[str, list[str]] = {}
    for line in lines:
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and not set(parts[0]) <= {"-"}:
            key = parts[0] if parts[0] not in out else f"{parts[0]} / {parts[1]}"
            out[key] = parts[1:]
    return out


def test_the_sweep_configs(avs):
    configs = avs.sweep_configs([0, 2, UNBOUNDED], [2])
    names = [name for name, _ in configs]
    assert names == ["sync", "async η=2", "async η=2 +partial", "async η=2 +partial no-keep-kv",
                     "async η=∞", "async η=∞ +partial"]
    assert [avs.slug(n) for n in names] == ["sync", "async_eta2", "async_eta2_partial", "async_eta2_partial_no-keep-kv",
                                            "async_etainf", "async_etainf_partial"]
    flags = dict(configs)
    assert flags["async η=2 +partial no-keep-kv"] == dict(mode="async", max_staleness=2, partial_rollout=True,
                                                          keep_kv_cache_on_update=False)
    for name, extra in configs:  # each one a valid run whose bound is the one its name says
        cfg = default_config(**extra)
        assert cfg.scheduler.staleness == (0 if name == "sync" else 2 if "η=2" in name else UNBOUNDED)
        assert cfg.engine.keep_kv_cache_on_update == ("no-keep" not in name)


def test_the_sweep_table_follows_the_figures(avs):
    def fig(tokens, samples, reward, kl, mixed):
        return dict(tokens_per_s=tokens, samples_per_s=samples, eval_reward=reward, mismatch_kl=kl,
                    mixed_version_kv_frac=mixed)

    results = {
        "sync s1": fig(100, 10, 0.50, 1e-4, 0.0), "sync s2": fig(200, 20, 0.52, 3e-4, 0.0),
        # each seed against its own sync: tokens 3.0 and 2.5 (median 2.75), samples 2.0 and 3.0
        "async η=2 s1": fig(300, 20, 0.60, 2e-4, 0.0), "async η=2 s2": fig(500, 60, 0.62, 4e-4, 0.0),
        "async η=2 +partial s1": fig(400, 40, 0.70, 5e-4, 0.25),
        "async η=2 +partial no-keep-kv s1": fig(350, 35, 0.65, 6e-4, 0.0),
    }
    lines = sweep_table(results, [0, 2, UNBOUNDED], [2], start={"eval_reward": 0.45, "eval_reward_se": 0.01})
    rows = cells(lines)
    assert rows["0"] == ["1.00×", "–", "1.00×", "–", "0.510", "–", "2.00e-04", "–", "–"]
    assert rows["2"] == ["2.75×", "4.00×", "2.50×", "4.00×", "0.610", "0.700", "3.00e-04", "5.00e-04", "25.0%"]
    assert rows["∞"] == ["–"] * 9  # not run
    assert rows["η=2 +partial"] == ["kept", "4.00×", "0.700", "5.00e-04", "25.0%"]
    assert rows["η=2 +partial / recomputed"] == ["recomputed", "3.50×", "0.650", "6.00e-04", "0.0%"]
    assert any("SFT start" in line and "0.450" in line for line in lines)


def test_a_tiny_sweep_run(avs, tmp_path):
    """Two configs on the CPU (sync and unbounded η with partial rollouts), their final policies
    scored on the held-out set; the logged table agrees with the per-config figures printed."""
    log = tmp_path / "log.md"
    cmd = [sys.executable, str(PATH), "--quick", "--sweep", "--etas", "0", "inf", "--only", "sync", "async_etainf_partial",
           "--work", str(tmp_path / "work"), "--results", str(log)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = {}
    for line in proc.stdout.splitlines():
        name, _, rest = line.partition(": {")
        if name in ("sync", "async η=∞ +partial"):
            figures[name] = json.loads("{" + rest)
    sync, unbounded = figures["sync"], figures["async η=∞ +partial"]
    assert unbounded["ledger_ok"] == 1.0 and 0.0 <= unbounded["eval_reward"] <= 1.0
    rows = cells(log.read_text().splitlines())
    assert rows["∞"][1] == f"{unbounded['tokens_per_s'] / sync['tokens_per_s']:.2f}×"
    assert rows["∞"][3] == f"{unbounded['samples_per_s'] / sync['samples_per_s']:.2f}×"
    assert rows["∞"][5] == f"{unbounded['eval_reward']:.3f}" and rows["0"][4] == f"{sync['eval_reward']:.3f}"
    assert rows["∞"][8] == f"{unbounded['mixed_version_kv_frac']:.1%}"
