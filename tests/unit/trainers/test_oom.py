"""Out-of-memory in the trainer (miles.trainers.oom): injected OOMs shrink the micro-batches and
the step trains the same tokens to the same weights; one sequence that does not fit fails clearly."""

from __future__ import annotations

import pytest
import torch

from miles.algorithms import AlgorithmConfig
from miles.trainers import EmbeddedTrainer, TrainerConfig
from miles.trainers.oom import TrainerOOMError
from tests.unit.trainers.conftest import make_model, random_groups, set_behaviour


def _trainer(**kw) -> EmbeddedTrainer:
    # adam_eps 1: a first AdamW step is lr·g/(|g|+1), linear in the gradient, so the two cuts'
    # float round-off stays round-off (with a tiny eps it is lr·sign(g), which noise can flip)
    return EmbeddedTrainer(make_model(), config=TrainerConfig(lr=1e-1, adam_eps=1.0, **kw), algo=AlgorithmConfig())


def _oom_above(n: int):
    calls = []

    def hook(rows) -> None:
        calls.append(len(rows))
        if len(rows) > n:
            raise torch.OutOfMemoryError("injected")
    return hook, calls


def test_injected_oom_splits_micro_batches_and_trains_the_same_tokens() -> None:
    groups = random_groups(num_groups=3, size=4)
    a, b = _trainer(), _trainer(micro_batch_size=2)
    set_behaviour(a, groups)
    a.oom.hook, calls = _oom_above(2)
    ma, mb = a.train_step(groups), b.train_step(groups)
    assert max(calls) > 2 and a.oom.recovered >= 1  # it did run out, and recovered
    assert ma["mem/oom_recovered"] == float(a.oom.recovered) and mb["mem/oom_recovered"] == 0.0
    assert ma["train/tokens"] == mb["train/tokens"] and ma["train/optimizer_steps"] == 1.0
    assert ma["train/loss"] == pytest.approx(mb["train/loss"], abs=1e-6)
    sa, sb, s0 = a.model.state_dict(), b.model.state_dict(), make_model().state_dict()
    assert max((sa[k] - s0[k]).abs().max().item() for k in sa) > 1e-4  # the step moved the weights
    assert max((sa[k] - sb[k]).abs().max().item() for k in sa) < 1e-6  # float32 round-off of the two cuts
    assert a.oom.config.micro_batch_size <= 2  # the smaller limit stays
    before = a.oom.recovered
    a.train_step(random_groups(num_groups=3, size=4, seed=1))
    assert a.oom.recovered == before


def test_oom_on_one_sequence_fails_naming_the_knobs() -> None:
    t = _trainer()
    t.oom.hook, _ = _oom_above(0)
    with pytest.raises(TrainerOOMError, match="--gradient-checkpointing"):
        t.train_step(random_groups())
