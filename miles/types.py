"""The data that crosses actors: trajectories, generation requests and outputs.

Every struct here is a msgspec Struct, so it encodes to msgpack (compact, fast, no pickle)
for Ray calls and checkpoints, and to JSON for dumps. Tensors never live in these structs:
per-token arrays are plain lists, which msgpack encodes natively and which the trainer turns
into tensors once per batch.

Invariants the rest of the system relies on (see docs/design.md):

- ``response_tokens``, ``logprobs``, ``versions`` and ``loss_mask`` always have the same
  length: one entry per response token. ``logprobs[i]`` is the behaviour log-prob the rollout
  engine sampled token i with (0.0 for tokens the environment wrote); ``versions[i]`` is the
  policy version whose weights produced token i (for environment tokens: the worker's
  version when it appended them); ``loss_mask[i]`` is 1 for tokens that carry loss.
- ``segments`` tile ``[0, len(response_tokens))`` in order; each is model-generated
  (loss-carrying) or environment-written (masked).
- Staleness of token i for a trainer at version v is ``v - versions[i]``; it is only ever
  checked on loss-carrying tokens.
"""

from __future__ import annotations

import enum
from bisect import bisect_right
from itertools import compress
from typing import Any, Literal

import msgspec


class TrajectoryError(ValueError):
    """A trajectory (or an operation on one) is invalid; ``field`` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:  # picklable across Ray actors
        return type(self), (self.field, self.message)


class Status(enum.StrEnum):
    """Life cycle: PENDING → RUNNING → (PARTIAL ↔ RUNNING)* → a terminal status."""

    PENDING = "pending"
    RUNNING = "running"
    PARTIAL = "partial"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED})

SegmentKind = Literal["model", "env"]


class Segment(msgspec.Struct, frozen=True, array_like=True):
    """A contiguous span ``[start, end)`` of the response, written by the model or the env."""

    start: int
    end: int
    kind: SegmentKind = "model"


Reward = float | dict[str, float]


def missing_reward_key(reward: dict[str, float], key: str) -> str:
    return f"the reward dict has no key {key!r} (keys: {', '.join(sorted(reward))}); --reward-key names one of them"


class Trajectory(msgspec.Struct, kw_only=True):
    """One sample: a prompt and the response generated (possibly over many turns) for it.

    The reward function receives this object as its ``sample``: it exposes ``.prompt``,
    ``.response`` (decoded text), ``.label`` and ``.metadata`` as slime's Sample does.
    """

    id: str
    prompt_id: str
    group_id: str
    index_in_group: int = 0
    prompt_tokens: list[int] = []
    response_tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    loss_mask: list[int] = []
    segments: list[Segment] = []
    # Per response token: the oldest policy version in the engine's K/V cache for the row
    # when the token was sampled (``versions[i]`` itself where the engine does not say).
    # Below ``versions[i]`` means the token continued on a cache kept across an update.
    kv_versions: list[int] = []
    # Optional MoE routing decisions per response token: [token][layer][top_k expert ids].
    routed_experts: list[list[list[int]]] | None = None
    status: Status = Status.PENDING
    finish_reason: str | None = None
    # Generation segments: 1 for an uninterrupted generation, +1 per resume after PARTIAL.
    num_segments: int = 0
    reward: Reward | None = None
    prompt: str = ""
    response: str = ""
    label: Any = None
    metadata: dict[str, Any] = {}

    # ---- derived views -------------------------------------------------------------
    @property
    def num_response_tokens(self) -> int:
        return len(self.response_tokens)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def loss_versions(self) -> list[int]:
        """Versions of the loss-carrying tokens (the ones staleness applies to)."""
        return [v for v, m in zip(self.versions, self.loss_mask) if m]

    @property
    def oldest_version(self) -> int | None:
        vs = self.loss_versions()
        return min(vs) if vs else None

    @property
    def newest_version(self) -> int | None:
        vs = self.loss_versions()
        return max(vs) if vs else None

    def max_staleness(self, trainer_version: int) -> int:
        """Largest ``trainer_version - token_version`` over loss-carrying tokens (0 if none)."""
        oldest = self.oldest_version
        return 0 if oldest is None else trainer_version - oldest

    def scalar_reward(self, key: str | None = None) -> float:
        """The reward as one float: the float itself, ``reward[key]``, or the dict's sum."""
        if self.reward is None:
            raise TrajectoryError("reward", f"trajectory {self.id} has no reward yet")
        if isinstance(self.reward, dict):
            if key and key not in self.reward:
                raise TrajectoryError("reward", f"trajectory {self.id}: {missing_reward_key(self.reward, key)}")
            return float(self.reward[key]) if key else float(sum(self.reward.values()))
        return float(self.reward)

    # ---- mutation helpers used by workers --------------------------------------------
    def append(
        self,
        tokens: list[int],
        logprobs: list[float],
        versions: list[int] | int,
        *,
        kind: SegmentKind = "model",
        kv_versions: list[int] | None = None,
    ) -> None:
        """Append a model- or environment-written span; env spans carry no loss."""
        n = len(tokens)
        if isinstance(versions, int):
            versions = [versions] * n
        if len(logprobs) != n or len(versions) != n:
            raise TrajectoryError(
                "append", f"{n} tokens but {len(logprobs)} logprobs and {len(versions)} versions"
            )
        if n == 0:
            return
        start = len(self.response_tokens)
        if len(self.kv_versions) == start:  # kept in step (a trajectory from before it is not)
            self.kv_versions.extend(kv_versions if kv_versions and len(kv_versions) == n else versions)
        self.response_tokens.extend(tokens)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
        self.loss_mask.extend([1 if kind == "model" else 0] * n)
        if self.segments and self.segments[-1].kind == kind and self.segments[-1].end == start:
            self.segments[-1] = Segment(self.segments[-1].start, start + n, kind)
        else:
            self.segments.append(Segment(start, start + n, kind))

    def validate(self, *, current_version: int | None = None) -> LossStats:
        """Raise TrajectoryError naming the first inconsistent field.

        ``current_version`` (the newest published policy version) lets callers reject tokens
        that claim to come from a future policy.

        Returns the loss-carrying tokens' ``(oldest version, count, version sum)`` (oldest
        None if none; ``loss_version_stats``), from the same passes over the versions and
        the mask that the checks make when every token carries loss: the replay buffer keeps
        them for every trajectory put.
        """
        return self.validate_runs(current_version=current_version)[0]

    def validate_runs(self, *, current_version: int | None = None) -> tuple[LossStats, VersionRuns | None]:
        """``validate``, and the versions as ascending runs (``version_runs``) when every
        token carries loss and the checks' pass found them (else None): the replay buffer
        keeps them, so that masking the stale prefix of a trajectory (``mask_stale``) needs
        no second pass over its versions."""
        n = len(self.response_tokens)
        if len(self.logprobs) != n or len(self.versions) != n or len(self.loss_mask) != n:
            for name in ("logprobs", "versions", "loss_mask"):
                got = len(getattr(self, name))
                if got != n:
                    raise TrajectoryError(name, f"has {got} entries for {n} response tokens")
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise TrajectoryError(
                "routed_experts", f"has {len(self.routed_experts)} rows for {n} response tokens"
            )
        if self.index_in_group < 0:
            raise TrajectoryError("index_in_group", f"must be >= 0, got {self.index_in_group}")
        lo, total, n_loss, runs = 0, 0, 0, None
        if n:
            lo, hi, total, runs = _version_summary(self.versions)
            if lo < 0:
                raise TrajectoryError("versions", f"negative policy version {lo}")
            if current_version is not None and hi > current_version:
                raise TrajectoryError(
                    "versions", f"version {hi} is newer than the current policy {current_version}"
                )
            mask = self.loss_mask
            n_loss = mask.count(1)  # all ones (the common case) needs no second loop; else
            if n_loss != n and n_loss + mask.count(0) != n:  # == as set(mask) <= {0, 1}
                raise TrajectoryError("loss_mask", "entries must be 0 or 1")
        if self.segments:
            pos = 0
            for seg in self.segments:
                if seg.start != pos or seg.end <= seg.start:
                    raise TrajectoryError("segments", f"segment {seg} does not continue at {pos}")
                pos = seg.end
            if pos != n:
                raise TrajectoryError("segments", f"cover {pos} of {n} response tokens")
        if n_loss == n:  # every token carries loss (the common case): the checks' own stats
            return ((lo, n, total), runs) if n else ((None, 0, 0), None)
        return loss_version_stats(self.versions, self.loss_mask), None


VersionRuns = list[tuple[int, int]]  # [(version, end), ...]: see ``version_runs``


def version_stats(versions: list[int]) -> tuple[int, int, int]:
    """(min, max, sum) of a non-empty list of policy versions.

    Runs on every put into the replay buffer (``Trajectory.validate``), over every token of
    the trajectory: a partial trajectory that spans a few weight updates is put back again
    and again as it grows. A trajectory's versions are
    few distinct values, and its first and last are the extremes in practice (versions
    only grow as it is generated), so this counts each value between them with
    ``list.count`` (a C loop that compares by identity first) and takes the sum from the
    counts: ~10× faster than ``min``, ``max`` and ``sum`` for one version, ~4× for three.
    When the counts do not cover the list (a version outside the ends), it falls back
    to ``min``, ``max`` and ``sum``; the result is the same either way."""
    return _version_summary(versions)[:3]  # type: ignore[return-value]


def _version_summary(versions: list[int]) -> tuple[int, int, int, VersionRuns | None]:
    """``version_stats`` and, from the same pass, ``version_runs`` where it found them (None
    where the list is not such runs, or where it did not look: a list in descending order)."""
    a, b = versions[0], versions[-1]
    if type(a) is int and type(b) is int and 0 <= b - a < 8:
        runs = version_runs(versions)
        if runs is not None:
            total, start = 0, 0
            for v, end in runs:
                total += v * (end - start)
                start = end
            return a, b, total, runs
    lo, hi = (a, b) if a <= b else (b, a)
    if type(lo) is int and type(hi) is int and hi - lo < 8:
        n, total, covered = len(versions), 0, 0
        for v in range(lo, hi + 1):
            c = versions.count(v)
            covered += c
            total += v * c
        if covered == n:
            return lo, hi, total, None
    return min(versions), max(versions), sum(versions), None


def version_runs(versions: list[int]) -> list[tuple[int, int]] | None:
    """``[(version, end), ...]``: the list as runs of one version each, ascending from its
    first entry to its last (fewer than 8 versions), each run from the previous one's end
    to its own; None when it is not such runs (then nothing is known about its order).

    Each run's end comes by bisection and the run is checked with a count over its own
    slice, where every compare is an identity hit. Counting each version over the whole
    list instead sends every token of the other versions down the slow compare path, which
    made this a replay buffer's largest cost at a thousand workers (benchmarks/simulate.py).
    Runs that tile the list prove it non-decreasing."""
    n = len(versions)
    a, b = versions[0], versions[-1]
    if not (type(a) is int and type(b) is int and 0 <= b - a < 8):
        return None
    if a == b:
        return [(a, n)] if versions.count(a) == n else None
    runs, start = [], 0
    for v in range(a, b + 1):
        end = bisect_right(versions, v, start)
        if versions[start:end].count(v) != end - start:
            return None
        runs.append((v, end))
        start = end
    return runs if start == n else None


LossStats = tuple[int | None, int, int]  # the loss tokens' (oldest version or None, count, version sum)


def loss_version_stats(versions: list[int], loss_mask: list[int]) -> LossStats:
    """``(oldest, count, sum)`` of the versions of loss-carrying tokens (oldest None if none).

    Runs on the buffer's put path (``Trajectory.validate``, for trajectories with
    environment-written tokens), so it stays in C builtins (``count``, ``compress``, and
    ``version_stats``' counting) and skips the selection when every token carries loss.
    ``loss_mask`` must hold only 0/1 (``Trajectory.validate`` checks that first).
    """
    n_loss = loss_mask.count(1)
    if n_loss == 0:
        return None, 0, 0
    lo, _, total = version_stats(versions if n_loss == len(versions) else list(compress(versions, loss_mask)))
    return lo, n_loss, total


class PromptSample(msgspec.Struct, kw_only=True):
    """One row of prompt data, before it becomes a group of trajectories."""

    prompt_id: str
    prompt: str = ""
    prompt_tokens: list[int] = []
    label: Any = None
    metadata: dict[str, Any] = {}


# ---- generation ----------------------------------------------------------------------


class SamplingParams(msgspec.Struct, kw_only=True):
    """Sampling controls, named as SGLang's ``sampling_params`` (temperature<=1e-6 is greedy).

    ``max_new_tokens`` is the response budget counted from the ORIGINAL prompt: a resumed
    request (``GenerateRequest.num_prefix_tokens`` = k) may add ``max_new_tokens - k`` more.
    Adapters for servers that count per call (SGLang) send the difference.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = []
    stop: list[str] = []
    ignore_eos: bool = False
    # With a seed, the random draw for the token at response position i depends only on
    # (seed, i), so an aborted and resumed generation reproduces an uninterrupted one.
    seed: int | None = None


FinishReason = Literal["stop", "length", "abort", "error"]


class GenerateRequest(msgspec.Struct, kw_only=True):
    """Generate a continuation of ``input_ids`` (prompt + any resumed prefix)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # Response tokens already generated before this call (a resume): position offset for
    # seeded sampling and for max-length accounting.
    num_prefix_tokens: int = 0
    return_routed_experts: bool = False
    return_hidden_states: bool = False


class GenerateOutput(msgspec.Struct, kw_only=True):
    """What one generate call produced. On abort it holds the tokens made so far."""

    rid: str
    output_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    # Per token: the oldest policy version in the row's K/V cache when it was sampled
    # (empty when the engine does not track it).
    kv_versions: list[int] = []
    finish_reason: FinishReason = "stop"
    matched_stop: int | str | None = None
    error: str | None = None
    routed_experts: list[list[list[int]]] | None = None
    # Speculative decoding stats for this request (0 when off).
    spec_verify_count: int = 0
    spec_accepted_tokens: int = 0


def finish_to_status(reason: FinishReason) -> Status:
    """Map an engine finish reason to a trajectory status (as slime reads SGLang's)."""
    return {
        "stop": Status.COMPLETED,
        "length": Status.TRUNCATED,
        "abort": Status.ABORTED,
        "error": Status.FAILED,
    }[reason]


# ---- codecs --------------------------------------------------------------------------

_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder(Trajectory)
_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder(Trajectory)


def encode(traj: Trajectory) -> bytes:
    return _msgpack_encoder.encode(traj)


def decode(data: bytes) -> Trajectory:
    return _msgpack_decoder.decode(data)


def to_json(traj: Trajectory) -> bytes:
    return _json_encoder.encode(traj)


def from_json(data: bytes | str) -> Trajectory:
    return _json_decoder.decode(data)
