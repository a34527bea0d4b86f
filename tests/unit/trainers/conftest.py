"""Tiny models and trajectory builders for the trainer tests."""

from __future__ import annotations

import pytest
import torch

from miles.models import CausalLM, tiny_config
from miles.types import Trajectory


def make_model(seed: int = 0, **overrides) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(tiny_config(initializer_range=0.1, **overrides))


def make_traj(
    tid: str,
    group: int,
    prompt: list[int],
    response: list[int],
    reward: float = 0.0,
    *,
    env: tuple[int, ...] = (),
    version: int = 0,
    logprobs: list[float] | None = None,
) -> Trajectory:
    """A trajectory whose response positions in ``env`` are environment-written (masked)."""
    t = Trajectory(id=tid, prompt_id=f"p{group}", group_id=f"g{group}", prompt_tokens=list(prompt))
    for i, tok in enumerate(response):
        lp = -1.0 if logprobs is None else logprobs[i]
        t.append([tok], [lp if i not in env else 0.0], version, kind="env" if i in env else "model")
    t.reward = reward
    return t


def random_groups(num_groups: int = 3, size: int = 4, seed: int = 0, vocab: int = 288) -> list[list[Trajectory]]:
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(num_groups):
        prompt = torch.randint(3, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        members = []
        for j in range(size):
            n = int(torch.randint(1, 7, (1,), generator=g))
            resp = torch.randint(3, vocab, (n,), generator=g).tolist()
            reward = float(torch.rand((), generator=g) > 0.5)
            members.append(make_traj(f"t{gi}_{j}", gi, prompt, resp, reward))
        groups.append(members)
    return groups


def set_behaviour(trainer, groups: list[list[Trajectory]], shift: float = 0.0) -> None:
    """Record the trainer's own log-probs (plus ``shift``) as behaviour log-probs."""
    flat = [t for g in groups for t in g]
    for t, lp in zip(flat, trainer.compute_logprobs(flat)):
        t.logprobs = [x + shift if m else 0.0 for x, m in zip(lp, t.loss_mask)]


@pytest.fixture
def groups() -> list[list[Trajectory]]:
    return random_groups()
