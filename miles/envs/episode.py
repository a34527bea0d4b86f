"""Episode bookkeeping kept in the trajectory itself (``metadata["env_episode"]``).

An episode can be parked as PARTIAL (an abort for a weight update in sync mode, a worker
shutting down), cut back by the buffer to the prefix it had when leased (a worker died), or
reset to nothing (recompute). Its turn structure therefore travels with the trajectory:
one ``TurnRecord`` per finished turn, with the spans of the action and of the observation
and a fingerprint of the observation. ``EpisodeState.of(traj)`` reads it back and keeps
only the turns that lie inside the response the trajectory still has, so the record and
the tokens always agree.

The live Env object stays with the worker that ran it; a worker that resumes an episode
without it rebuilds one by replaying: ``reset`` and the recorded actions, checking that
every observation has the same fingerprint (an Env must be deterministic given the sample
and the actions for that; otherwise the episode fails with ``env_replay_mismatch``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from miles.types import Trajectory

KEY = "env_episode"


class TurnRecord(msgspec.Struct, array_like=True):
    """One finished turn: action ``[start, end)``, observation ``[end, obs_end)``."""

    start: int
    end: int
    obs_end: int
    obs_hash: str
    reward: float


class EpisodeState(msgspec.Struct, kw_only=True):
    reset_hash: str | None = None  # fingerprint of reset's observation (None: not reset yet)
    turns: list[TurnRecord] = []
    elapsed_s: float = 0.0  # wall time spent on the episode by workers (parked time excluded)
    info: dict[str, Any] = {}  # the Env's last ``info``, made JSON-safe

    @classmethod
    def of(cls, traj: Trajectory) -> EpisodeState:
        raw = traj.metadata.get(KEY)
        try:
            state = msgspec.convert(raw, cls) if raw else cls()
        except msgspec.ValidationError:
            state = cls()  # unreadable: start over (the caller checks the response is empty)
        n = len(traj.response_tokens)
        keep = 0
        for turn in state.turns:
            if turn.obs_end > n:
                break
            keep += 1
        del state.turns[keep:]
        return state

    def save(self, traj: Trajectory) -> None:
        traj.metadata[KEY] = msgspec.to_builtins(self)

    @property
    def turn_start(self) -> int:
        """Where the open (current) model turn starts in the response."""
        return self.turns[-1].obs_end if self.turns else 0

    def rewards(self) -> list[float]:
        return [t.reward for t in self.turns]


def json_safe(value: Any) -> Any:
    """``value`` as msgpack/JSON-encodable builtins (unknown objects become strings)."""
    try:
        return msgspec.to_builtins(value, enc_hook=str, str_keys=True)
    except Exception:
        return str(value)
