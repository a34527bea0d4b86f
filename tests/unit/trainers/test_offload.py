"""--offload-train (miles.trainers.offload): AdamW state round-trips bit for bit, and a run with
offload trains exactly as one without."""

from __future__ import annotations

import torch

from miles.algorithms import AlgorithmConfig
from miles.trainers import EmbeddedTrainer, TrainerConfig
from tests.unit.trainers.conftest import make_model, random_groups, set_behaviour


def _trainer(**kw) -> EmbeddedTrainer:
    return EmbeddedTrainer(make_model(), config=TrainerConfig(lr=1e-2, **kw), algo=AlgorithmConfig())


def _moments(tr: EmbeddedTrainer) -> list[torch.Tensor]:
    return [t.clone() for s in tr.optimizer.state.values() for k, t in sorted(s.items()) if t.numel() > 1]


def test_offload_round_trips_optimizer_state_bitwise() -> None:
    tr = _trainer(offload_train=True)
    groups = random_groups()
    set_behaviour(tr, groups)
    m = tr.train_step(groups)
    assert tr.offloader.offloaded and "mem/offload_train_s" in m
    hosted = _moments(tr)
    assert hosted and tr.offloader.host_bytes() == sum(t.numel() * t.element_size() for t in hosted)
    tr.offloader.reload()
    back = _moments(tr)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(hosted, back))
    tr.offloader.offload()
    assert all(torch.equal(a, b) for a, b in zip(hosted, _moments(tr)))


def test_offloaded_run_trains_like_a_resident_one() -> None:
    a, b = _trainer(offload_train=True), _trainer()
    for seed in range(3):
        groups = random_groups(seed=seed)
        set_behaviour(a, groups)
        a.train_step(groups)
        b.train_step(groups)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
