"""Property-based tests: random interleavings of everything a run does to the buffer.

A hypothesis state machine admits prompts, leases to several workers, puts results back
(finished, failed or PARTIAL, with token versions between the lease-time and the current
version), bumps versions, takes batches, lets leases expire, kills workers, renews, and
round-trips the whole state through msgpack into a fresh buffer. Workers hold copies (as
through Ray) and keep them after their lease is gone, so late puts happen too.

Checked after every step: the ledger balances and matches the model; nothing handed out
twice; every batch is whole groups; every loss token handed out is within the bound;
refused calls change nothing.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from miles.buffers import BufferFull, drop_uniform_rewards
from miles.buffers.records import IN_FLIGHT
from miles.types import Status, TrajectoryError

from tests.unit.buffers.helpers import FakeClock, generate, make_buffer, prompts, snapshot

WORKERS = ("w0", "w1", "w2")
TIMEOUT = 10.0
# weighted by repetition: mostly finished, often partial, now and then failed
OUTCOMES = (Status.COMPLETED,) * 4 + (Status.TRUNCATED,) + (Status.PARTIAL,) * 3 + (Status.FAILED,)


class BufferMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["drop", "recompute", "mask"]),
        eta=st.integers(0, 2),
        n=st.integers(1, 3),
        capacity=st.integers(3, 12),
        use_filter=st.booleans(),
    )
    def setup(self, policy: str, eta: int, n: int, capacity: int, use_filter: bool) -> None:
        self.clock = FakeClock()
        self.cfg = dict(
            max_staleness=eta, stale_policy=policy, capacity=capacity,
            n_samples_per_prompt=n, lease_timeout_s=TIMEOUT,
            group_filters=[drop_uniform_rewards] if use_filter else [],
        )
        self.buf = make_buffer(self.clock, **dict(self.cfg))
        self.eta, self.n, self.capacity = eta, n, capacity
        self.version = 0
        self.admitted = 0
        self.next_prompt = 0
        self.trained: set[str] = set()
        self.held: dict[str, dict] = {w: {} for w in WORKERS}  # the workers' copies
        self.leases: dict[str, set[str]] = {w: set() for w in WORKERS}  # model of the leases
        self.deadline: dict[str, float] = dict.fromkeys(WORKERS, 0.0)
        self.lease_version: dict[str, int] = {}

    # ---- the driver ----------------------------------------------------------------
    @rule(k=st.integers(1, 3))
    def add_prompts(self, k: int) -> None:
        room = self.capacity - self.buf.ledger().live
        before = snapshot(self.buf)
        try:
            self.buf.add_prompts(prompts(k, start=self.next_prompt))
        except BufferFull:
            assert k * self.n > room
            assert snapshot(self.buf) == before
            return
        assert k * self.n <= room
        self.next_prompt += k
        self.admitted += k * self.n

    @rule()
    def top_up(self) -> None:
        """The driver admits as many prompts as fit (volume for the other rules)."""
        k = self.buf.prompt_room()
        self.buf.add_prompts(prompts(k, start=self.next_prompt))
        self.next_prompt += k
        self.admitted += k * self.n
        assert self.buf.prompt_room() == 0

    @rule()
    def bump_version(self) -> None:
        self.version += 1
        self.buf.set_version(self.version)

    @rule()
    def train(self) -> None:
        """The trainer's usual call: one group at the current version (weights progress)."""
        self.get_batch(1, 0)

    @rule(k=st.integers(1, 2), ahead=st.integers(0, 1))
    def get_batch(self, k: int, ahead: int) -> None:
        """``ahead``: the trainer may already be one step past the published version."""
        trainer_version = self.version + ahead
        batch = self.buf.get_batch(k, trainer_version)
        assert len(batch) in (0, k)
        for group in batch:
            assert len(group) == self.n
            assert [t.index_in_group for t in group] == list(range(self.n))
            assert len({t.group_id for t in group}) == 1
            for t in group:
                assert t.status.finished and t.status is not Status.FAILED
                assert t.id not in self.trained, "handed out twice"
                self.trained.add(t.id)
                t.validate(current_version=self.version)
                for v, m in zip(t.versions, t.loss_mask):
                    assert not m or trainer_version - v <= self.eta, "staleness bound broken"

    # ---- workers -------------------------------------------------------------------
    @rule(worker=st.sampled_from(WORKERS), m=st.integers(1, 4))
    def lease(self, worker: str, m: int) -> None:
        self._lease(worker, m)

    def _lease(self, worker: str, m: int) -> None:
        got = self.buf.lease(worker, m)
        everyone = set().union(*self.leases.values())
        for t in got:
            assert t.id not in everyone, "leased twice"
            assert t.id not in self.trained
            assert t.status is Status.RUNNING
            self.held[worker][t.id] = msgspec.msgpack.decode(msgspec.msgpack.encode(t), type=type(t))
            self.lease_version[t.id] = self.version
        if got or self.leases[worker]:
            self.deadline[worker] = self.clock.now + TIMEOUT
        self.leases[worker] |= {t.id for t in got}
        if len(got) < m:
            led = self.buf.ledger()
            assert led.queued == 0 and led.partial == 0, "work left behind"

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def put(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from([w for w in WORKERS if self.held[w]]))
        self._put_some(worker, data)

    @rule(worker=st.sampled_from(WORKERS), m=st.integers(1, 4), data=st.data())
    def work(self, worker: str, m: int, data: st.DataObject) -> None:
        """A worker's loop turn: ask for work, then return some of what it holds."""
        self._lease(worker, m)
        if self.held[worker]:
            self._put_some(worker, data)

    @rule(worker=st.sampled_from(WORKERS), m=st.integers(1, 4), data=st.data())
    def work_more(self, worker: str, m: int, data: st.DataObject) -> None:
        """Same as ``work``: listed twice so that progress outweighs disruption."""
        self.work(worker, m, data)

    def _put_some(self, worker: str, data: st.DataObject) -> None:
        held = sorted(self.held[worker])
        ids = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=4, unique=True))
        results = []
        for tid in ids:
            traj = self.held[worker][tid]
            status = data.draw(st.sampled_from(OUTCOMES))
            version = data.draw(st.integers(min(self.lease_version[tid], self.version), self.version))
            tokens = data.draw(st.integers(0 if status is Status.PARTIAL else 1, 3))
            results.append(generate(traj, version, tokens, status=status,
                                    reward=float(data.draw(st.integers(0, 1)))))
        before = snapshot(self.buf)
        if set(ids) <= self.leases[worker]:
            self.buf.put_many(results, worker)
            self.leases[worker] -= set(ids)
            self.deadline[worker] = self.clock.now + TIMEOUT
            for tid in ids:
                del self.held[worker][tid]
        else:  # at least one lease is gone: refused as a whole
            with pytest.raises(TrajectoryError):
                self.buf.put_many(results, worker)
            assert snapshot(self.buf) == before
            for tid in set(ids) - self.leases[worker]:
                del self.held[worker][tid]  # the worker learns and forgets it

    @rule(worker=st.sampled_from(WORKERS))
    def renew(self, worker: str) -> None:
        self.buf.renew(worker)
        if self.leases[worker]:
            self.deadline[worker] = self.clock.now + TIMEOUT

    @rule(dt=st.sampled_from([1.0, 4.0, TIMEOUT]))
    def expire(self, dt: float) -> None:
        self.clock.now += dt
        expected = 0
        for w in WORKERS:
            if self.leases[w] and self.deadline[w] <= self.clock.now:
                expected += len(self.leases[w])
                self.leases[w] = set()
        assert self.buf.expire_leases() == expected

    @rule(worker=st.sampled_from(WORKERS))
    def kill_worker(self, worker: str) -> None:
        assert self.buf.release_worker(worker) == len(self.leases[worker])
        self.leases[worker] = set()
        self.held[worker] = {}

    # ---- checkpoint ----------------------------------------------------------------
    @rule()
    def round_trip(self) -> None:
        data = msgspec.msgpack.encode(self.buf.state_dict())
        fresh = make_buffer(self.clock, **dict(self.cfg))
        fresh.load_state_dict(msgspec.msgpack.decode(data))
        assert snapshot(fresh) == data
        self.buf = fresh

    # ---- invariants ----------------------------------------------------------------
    @invariant()
    def ledger_balances(self) -> None:
        if not hasattr(self, "buf"):
            return
        led = self.buf.ledger()
        led.check()
        assert led.admitted == self.admitted
        assert led.trained == len(self.trained)
        assert led.in_flight == sum(len(s) for s in self.leases.values())
        assert led.live <= self.capacity
        assert led.ready == self.n * led.groups.ready
        for w in WORKERS:
            assert set(self.buf.leased(w)) == self.leases[w]

    @invariant()
    def nothing_lost_or_duplicated(self) -> None:
        if not hasattr(self, "buf"):
            return
        live = [r[0] for r in self.buf.state_dict()["records"]]
        assert len(live) == len(set(live)) == self.buf.ledger().live
        assert not set(live) & self.trained

    @invariant()
    def dropped_groups_hold_only_in_flight_members(self) -> None:
        if not hasattr(self, "buf"):
            return
        state = self.buf.state_dict()
        where = {r[0]: r[1] for r in state["records"]}
        for _, _, _, _, _, reason, member_ids in state["groups"]:
            if reason is not None:
                assert all(where[tid] == IN_FLIGHT for tid in member_ids)

    def teardown(self) -> None:
        """Drain: kill every worker, finish everything, train it all — nothing may remain."""
        if not hasattr(self, "buf"):
            return
        for w in WORKERS:
            self.buf.release_worker(w)
        for _ in range(3):
            leased = self.buf.lease("drain", 10**6)
            self.buf.put_many(
                [generate(t, self.version, reward=float(i % 2)) for i, t in enumerate(leased)], "drain")
            ready = self.buf.ledger().groups.ready
            if ready:
                self.get_batch(ready, 0)
        led = self.buf.ledger()
        assert led.live == 0, f"left behind: {led}"
        led.check()


BufferMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBufferMachine = BufferMachine.TestCase
