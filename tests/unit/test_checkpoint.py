"""Checkpoint files: tree round trip without pickle, atomic commit and retention,
corruption and model-shape mismatch refused with a clear message."""

from __future__ import annotations

import pytest
import torch

from miles.checkpoint import CheckpointError, CheckpointManager, load_tree, resolve_checkpoint, save_tree


def _tree():
    return {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2)}, "step": 5,
            "opt": [{"lr": 0.1, "m": torch.ones(2)}], "rng": torch.get_rng_state(), "name": None}


def test_tree_round_trip(tmp_path) -> None:
    tree = _tree()
    save_tree(tmp_path, "t", tree)
    back = load_tree(tmp_path, "t")
    assert back["step"] == 5 and back["name"] is None and back["opt"][0]["lr"] == 0.1
    assert torch.equal(back["model"]["w"], tree["model"]["w"]) and torch.equal(back["rng"], tree["rng"])
    assert not list(tmp_path.glob("*.pkl")) and not list(tmp_path.glob("*.pt"))


def _save(mgr: CheckpointManager, step: int):
    tmp = mgr.begin(step)
    save_tree(tmp, "trainer", _tree())
    return mgr.commit(tmp, step, {"version": step})


def test_commit_latest_and_retention(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        _save(mgr, step)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000003"]
    assert resolve_checkpoint(tmp_path).name == "step_000003"


def test_crash_mid_save_keeps_previous(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 1)
    tmp = mgr.begin(2)  # the process dies here: files half written, never committed
    (tmp / "trainer.safetensors").write_bytes(b"garbage")
    assert resolve_checkpoint(tmp_path).name == "step_000001"


def test_corrupt_files_refused(tmp_path) -> None:
    final = _save(CheckpointManager(tmp_path), 1)
    data = bytearray((final / "trainer.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (final / "trainer.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        resolve_checkpoint(tmp_path)
    (final / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest"):
        resolve_checkpoint(final)
    with pytest.raises(CheckpointError, match="not a miles checkpoint"):
        resolve_checkpoint(tmp_path / "missing")


def test_trainer_state_from_other_model_shape_is_refused() -> None:
    from miles.algorithms import AlgorithmConfig
    from miles.models import CausalLM, tiny_config
    from miles.trainers import EmbeddedTrainer, TrainerConfig

    small = EmbeddedTrainer(CausalLM(tiny_config()), config=TrainerConfig(), algo=AlgorithmConfig())
    wide = EmbeddedTrainer(CausalLM(tiny_config(hidden_size=96, head_dim=24)), config=TrainerConfig(),
                           algo=AlgorithmConfig())
    with pytest.raises(Exception, match="shape|size"):
        small.load_state_dict(wide.state_dict())
