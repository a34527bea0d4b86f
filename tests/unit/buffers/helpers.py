"""Shared helpers for the buffer tests: fake clock, prompts, and a worker's edits.

Workers here get *copies* of leased trajectories (``ray_copy``), as they do through Ray,
so the tests see exactly what crosses the actor boundary.
"""

from __future__ import annotations

import msgspec

from miles.buffers import BufferConfig, ReplayBuffer
from miles.types import PromptSample, Status, Trajectory, decode, encode


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prompts(k: int, start: int = 0) -> list[PromptSample]:
    return [PromptSample(prompt_id=f"p{i}", prompt_tokens=[1, 2, 3]) for i in range(start, start + k)]


def make_buffer(clock: FakeClock | None = None, **config) -> ReplayBuffer:
    kwargs = {k: config.pop(k) for k in ("sampling_policy", "eviction_policy", "group_filters") if k in config}
    return ReplayBuffer(BufferConfig(**config), clock=clock or FakeClock(), **kwargs)


def ray_copy(traj: Trajectory) -> Trajectory:
    return decode(encode(traj))


def generate(
    traj: Trajectory,
    version: int,
    n_tokens: int = 2,
    *,
    status: Status = Status.COMPLETED,
    reward: float | None = 1.0,
    env_tokens: int = 0,
) -> Trajectory:
    """A worker's result: ``n_tokens`` model tokens at ``version`` (+ env tokens), as a copy."""
    out = ray_copy(traj)
    out.num_segments += 1
    out.append(list(range(n_tokens)), [-0.5] * n_tokens, version)
    if env_tokens:
        out.append([9] * env_tokens, [0.0] * env_tokens, version, kind="env")
    out.status = status
    if status is not Status.PARTIAL:
        out.reward = reward
    return out


def snapshot(buf: ReplayBuffer) -> bytes:
    """The buffer's whole state as bytes (to assert a failed call changed nothing)."""
    return msgspec.msgpack.encode(buf.state_dict())


def run_groups(buf: ReplayBuffer, k: int, version: int = 0, worker: str = "w") -> list[str]:
    """Admit k prompts, lease everything, finish it at ``version``; return group ids."""
    gids = buf.add_prompts(prompts(k, start=buf.ledger().groups.admitted))
    leased = buf.lease(worker, 10**6)
    buf.put_many([generate(t, version) for t in leased], worker)
    return gids
