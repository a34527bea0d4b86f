"""``miles inspect`` and ``miles plot`` on a run's outputs as RunOutputs writes them: decoded
text, token versions and env spans; a run's output dir in place of its dump; one-line errors
for what a user can get wrong; a metrics file whose last line a run is still writing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles import cli
from miles.config import parse_args
from miles.models import CausalLM, build_tiny_tokenizer, save_pretrained, tiny_config
from miles.outputs import RunOutputs
from tests.unit.trainers.conftest import make_traj


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A finished run's output dir: config.yaml naming a checkpoint with tokenizer.json, and a
    dump of one step with a resumed trajectory and one with an environment span."""
    ckpt = tmp_path / "ckpt"
    tok = build_tiny_tokenizer()
    save_pretrained(CausalLM(tiny_config()), ckpt, tokenizer=tok)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"input": "hi", "label": "x"}) + "\n")
    rm = tmp_path / "rm.py"
    rm.write_text("def reward(sample):\n    return 0.0\n")
    out = tmp_path / "out"
    cfg = parse_args(["--hf-checkpoint", str(ckpt), "--prompt-data", str(data), "--output-dir", str(out),
                      "--custom-rm-path", f"{rm}:reward", "--dump-trajectories"])
    outputs = RunOutputs(cfg)
    say = tok.encode("say 7:")
    resumed = make_traj("t-resumed", 0, say, tok.encode(" 7 and"), 1.0)
    for tok_id in tok.encode(" more"):
        resumed.append([tok_id], [-0.5], 1)
    tool = make_traj("t-tool", 0, say, tok.encode("call[42]ok"), 0.25, env=(4, 5, 6, 7))
    outputs.dump_batch(3, 2, [[resumed, tool]])
    for step in (1, 2):
        outputs.log_step(step, {"rollout/reward_mean": 0.1 * step, "buffer/staleness_max": 1.0})
    outputs.close()
    return out


def _inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli.main(["inspect", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_inspect_decodes_a_dump_with_versions_and_env_spans(run_dir: Path, capsys) -> None:
    rc, out, _ = _inspect(capsys, str(run_dir / "trajectories.jsonl"))
    assert rc == 0
    first, second = out.split("── ")[1:]
    assert first.startswith("t-resumed") and "reward=1.0" in first and "trainer_version=2" in first
    assert "versions: v0×6 v1×5" in first
    assert "prompt:   say 7:" in first and "response:  7 and more" in first
    assert "response: call[env: [42]]ok" in second and "reward=0.25" in second


def test_inspect_takes_the_run_dir_and_filters(run_dir: Path, capsys) -> None:
    rc, out, _ = _inspect(capsys, str(run_dir), "--id", "t-tool")
    assert rc == 0 and out.count("── ") == 1 and "t-tool" in out
    rc, out, _ = _inspect(capsys, str(run_dir), "--limit", "1")
    assert rc == 0 and out.count("── ") == 1 and "t-resumed" in out


@pytest.mark.parametrize("case", ["missing", "dir without dump", "not json", "not a trajectory"])
def test_inspect_errors_are_one_line(case: str, run_dir: Path, tmp_path: Path, capsys) -> None:
    target = tmp_path / "bad.jsonl"
    if case == "missing":
        expect = "file not found"
    elif case == "dir without dump":
        target = tmp_path / "empty"
        target.mkdir()
        expect = "no trajectories.jsonl"
    elif case == "not json":
        target.write_text((run_dir / "trajectories.jsonl").read_text() + "{oops\n")
        expect = "bad.jsonl:3: not JSON"
    else:
        target.write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.5}) + "\n")
        expect = "bad.jsonl:1: not a trajectory"
    rc, _, err = _inspect(capsys, str(target))
    assert rc == 2
    assert err.startswith("miles inspect: error:") and expect in err and err.count("\n") == 1


def test_plot_draws_a_png_and_skips_a_line_still_being_written(run_dir: Path, capsys) -> None:
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 3, "rollout/rew')  # a run writing its next line
    assert cli.main(["plot", str(run_dir)]) == 0
    png = run_dir / "curves.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("case", ["no metrics", "corrupt line"])
def test_plot_errors_are_one_line(case: str, run_dir: Path, tmp_path: Path, capsys) -> None:
    target = tmp_path / "empty"
    target.mkdir()
    expect = "no metrics.jsonl"
    if case == "corrupt line":
        target = run_dir
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        (run_dir / "metrics.jsonl").write_text("\n".join([lines[0], "{oops", lines[1]]) + "\n")
        expect = "metrics.jsonl:2: not JSON"
    rc = cli.main(["plot", str(target)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("miles plot: error:") and expect in err and err.count("\n") == 1
