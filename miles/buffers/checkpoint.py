"""``ReplayBuffer.state_dict`` / ``load_state_dict``, and the checks on admitted groups.

The state is plain msgpack-able data (no pickle): trajectories as msgpack bytes
(``miles.types.encode``, an immutable snapshot), records, groups, queue orders, leases
with their remaining time, and every counter. Loading it into a fresh buffer continues
the run with nothing lost or duplicated: leased trajectories stay leased to the same
workers (which may put them back, or expire), queues keep their order.

Split out of ``replay.py`` to keep files readable; it works on the buffer's internals.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import msgspec

from miles.buffers.core import BufferCore, _Worker
from miles.buffers.ledger import LedgerError
from miles.buffers.records import PARTIAL, READY, WAITING, Group, Record
from miles.types import Status, Trajectory, TrajectoryError, decode, encode, loss_version_stats

FORMAT = 1


def dump(buf: BufferCore) -> dict[str, Any]:
    now = buf._clock()
    recs = buf._recs.values()
    return {
        "format": FORMAT,
        "version": buf._version,
        "seq": buf._seq,
        "gseq": buf._gseq,
        "trajectories": [encode(r.traj) for r in recs],
        # [id, state, worker, snapshot, partial-heap key] per held trajectory
        "records": [[r.traj.id, r.state, r.worker, list(r.snap), r.key] for r in recs],
        # [id, prompt id, size, seq, ready seq, drop reason, held member ids]
        "groups": [
            [g.group_id, g.prompt_id, g.size, g.seq, g.ready_seq, g.dropped,
             [r.traj.id for r in g.members if r.state is not None]]
            for g in buf._groups.values()
        ],
        "pending": list(buf._pending),
        "partial": sorted(
            [o, key, tid] for o, key, tid in buf._partial
            if (r := buf._recs.get(tid)) is not None and r.state == PARTIAL and r.key == key
        ),
        "ready": list(buf._ready),
        "workers": [[wid, w.deadline - now, list(w.recs)] for wid, w in buf._workers.items()],
        "events": dict(buf._ev),
        "dropped": dict(buf._dropped),
        "groups_dropped": dict(buf._gdropped),
        "last_batch": dict(buf._last_batch),
    }


def _as_trajectory(item: Any) -> Trajectory:
    if isinstance(item, Trajectory):
        return msgspec.structs.replace(item)
    if isinstance(item, (bytes, bytearray, memoryview)):
        return decode(bytes(item))
    return msgspec.convert(item, Trajectory)


def load(buf: BufferCore, state: dict[str, Any]) -> None:
    if state.get("format") != FORMAT:
        raise ValueError(f"buffer state: format {state.get('format')!r}, expected {FORMAT}")
    trajs = {t.id: t for t in map(_as_trajectory, state["trajectories"])}
    buf._clear()
    buf._version, buf._seq, buf._gseq = int(state["version"]), int(state["seq"]), int(state["gseq"])
    groups = {}
    for gid, pid, size, seq, ready_seq, dropped, member_ids in state["groups"]:
        group = Group(gid, pid, size, seq)
        group.ready_seq, group.dropped = ready_seq, dropped
        for tid in member_ids:
            group.members.append(Record(trajs[tid], group, None))  # type: ignore[arg-type]
            group.n_live += 1
        groups[gid] = group
    by_id = {r.traj.id: r for g in groups.values() for r in g.members}
    for tid, st, worker, snap, key in state["records"]:
        rec = by_id[tid]
        rec.state, rec.worker, rec.snap, rec.key = st, worker, (snap[0], snap[1]), key
        rec.oldest, rec.n_loss, rec.vsum = loss_version_stats(rec.traj.versions, rec.traj.loss_mask)
        buf._count[st] += 1
        if st in (WAITING, READY):
            rec.group.n_finished += 1
        buf._recs[tid] = rec
    buf._groups = groups
    buf._pending.update((tid, by_id[tid]) for tid in state["pending"])
    buf._partial = [(o, key, tid) for o, key, tid in state["partial"]]
    heapq.heapify(buf._partial)
    buf._ready.update((gid, groups[gid]) for gid in state["ready"])
    now = buf._clock()
    for wid, remaining, ids in state["workers"]:
        w = buf._workers[wid] = _Worker(now + remaining)
        w.recs.update((tid, by_id[tid]) for tid in ids)
    buf._ev.update(state["events"])
    buf._dropped.update(state["dropped"])
    buf._gdropped.update(state["groups_dropped"])
    buf._last_batch.update(state["last_batch"])
    try:
        buf.ledger().check()
    except LedgerError as exc:
        raise ValueError(f"buffer state does not balance: {exc}") from exc


def check_new_groups(buf: BufferCore, groups: Sequence[Sequence[Trajectory]]) -> None:
    """Validate ``add_groups`` input; raise TrajectoryError naming the field."""
    ids: set[str] = set()
    gids: set[str] = set()
    for members in groups:
        if not members:
            raise TrajectoryError("group_id", "an empty group cannot be admitted")
        gid, pid = members[0].group_id, members[0].prompt_id
        if gid in buf._groups or gid in gids:
            raise TrajectoryError("group_id", f"group {gid!r} is already held")
        gids.add(gid)
        if sorted(t.index_in_group for t in members) != list(range(len(members))):
            raise TrajectoryError("index_in_group", f"group {gid!r} must hold indices 0..{len(members) - 1}")
        for t in members:
            if t.group_id != gid:
                raise TrajectoryError("group_id", f"{t.id!r} has group {t.group_id!r}, not {gid!r}")
            if t.prompt_id != pid:
                raise TrajectoryError("prompt_id", f"{t.id!r} has prompt {t.prompt_id!r}, not {pid!r}")
            if t.id in buf._recs or t.id in ids:
                raise TrajectoryError("id", f"duplicate trajectory id {t.id!r}")
            ids.add(t.id)
            if t.status not in (Status.PENDING, Status.PARTIAL):
                raise TrajectoryError("status", f"{t.id!r}: admitted samples must be PENDING or PARTIAL, got {t.status}")
            if t.status is Status.PENDING and t.response_tokens:
                raise TrajectoryError("status", f"{t.id!r} is PENDING but has response tokens")
            t.validate(current_version=buf._version)

