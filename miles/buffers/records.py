"""The buffer's bookkeeping records: one ``Record`` per live trajectory, one ``Group`` per prompt.

Internal to ``miles.buffers`` except ``Group``, which sampling and eviction policies receive
(read-only by convention). Also the two trajectory rewrites the buffer performs: ``reset``
(the "recompute" policy: back to a fresh PENDING sample) and ``restore`` (a lease that ends
without a put: back to what the buffer handed out).
"""

from __future__ import annotations

import msgspec

from miles.types import Segment, Status, Trajectory

# Where a live trajectory is. Trained and dropped ones leave the buffer (state None).
QUEUED, PARTIAL, IN_FLIGHT, WAITING, READY = range(5)
STATE_NAMES = ("queued", "partial", "in_flight", "waiting", "ready")


class Record:
    """A live trajectory plus what the buffer knows about it.

    ``oldest``/``n_loss``/``vsum`` summarise the loss-token versions (computed once per put);
    ``runs`` are the versions as ascending runs when every token carries loss (from the
    same put's check, ``Trajectory.validate_runs``; None when not known), for the mask
    policy; ``key`` is its position in the partial heap (valid only while it equals the
    heap entry's sequence number: entries are deleted lazily); ``snap`` is the response
    length and segment count at lease time.
    """

    __slots__ = ("traj", "group", "state", "worker", "snap", "key", "oldest", "n_loss", "vsum", "runs")

    def __init__(self, traj: Trajectory, group: Group, state: int) -> None:
        self.traj = traj
        self.group = group
        self.state: int | None = state
        self.worker: str | None = None
        self.snap: tuple[int, int] = (0, 0)
        self.key = -1
        self.oldest: int | None = None
        self.n_loss = 0
        self.vsum = 0
        self.runs: list[tuple[int, int]] | None = None


class Group:
    """The ``size`` samples of one prompt. Policies read ``trajectories``,
    ``oldest_version``, ``seq`` (admission order) and ``ready_seq`` (order it became ready)."""

    __slots__ = ("group_id", "prompt_id", "size", "members", "seq", "ready_seq",
                 "n_finished", "n_live", "dropped")

    def __init__(self, group_id: str, prompt_id: str, size: int, seq: int) -> None:
        self.group_id = group_id
        self.prompt_id = prompt_id
        self.size = size
        self.members: list[Record] = []
        self.seq = seq
        self.ready_seq = -1
        self.n_finished = 0  # members WAITING or READY
        self.n_live = 0  # members still held by the buffer
        self.dropped: str | None = None  # the reason, once the group is dropped

    @property
    def trajectories(self) -> list[Trajectory]:
        return [r.traj for r in self.members]

    @property
    def oldest_version(self) -> int | None:
        """Oldest loss-token version over the members (None: no loss tokens at all)."""
        olds = [r.oldest for r in self.members if r.oldest is not None]
        return min(olds) if olds else None

    def __repr__(self) -> str:
        return f"Group({self.group_id!r}, size={self.size}, dropped={self.dropped!r})"


def reset(traj: Trajectory) -> None:
    """Discard the response: the trajectory becomes a fresh PENDING sample of its prompt."""
    traj.response_tokens = []
    traj.logprobs = []
    traj.versions = []
    traj.kv_versions = []
    traj.loss_mask = []
    traj.segments = []
    traj.routed_experts = None
    traj.status = Status.PENDING
    traj.finish_reason = None
    traj.num_segments = 0
    traj.reward = None
    traj.response = ""


def restore(traj: Trajectory, snap: tuple[int, int]) -> Trajectory:
    """A copy of ``traj`` cut back to its lease-time prefix, PARTIAL or PENDING.

    In-process, a worker mutates the very object it leased; a copy detaches the buffer from
    a worker that is gone (or just late), so its later writes cannot leak back in.
    """
    n, num_segments = snap
    segments: list[Segment] = []
    for seg in traj.segments:
        if seg.start >= n:
            break
        segments.append(seg if seg.end <= n else Segment(seg.start, n, seg.kind))
    routed = traj.routed_experts
    return msgspec.structs.replace(
        traj,
        response_tokens=traj.response_tokens[:n],
        logprobs=traj.logprobs[:n],
        versions=traj.versions[:n],
        kv_versions=traj.kv_versions[:n],
        loss_mask=traj.loss_mask[:n],
        segments=segments,
        routed_experts=None if routed is None else routed[:n],
        status=Status.PARTIAL if n else Status.PENDING,
        finish_reason=None,
        num_segments=num_segments,
        reward=None,
        # The decoded text cannot be cut by tokens; the worker re-decodes a cut response.
        response=traj.response if len(traj.response_tokens) == n else "",
        metadata=dict(traj.metadata),
    )
