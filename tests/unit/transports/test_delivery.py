"""Trainer → broadcaster → workers in one process (object store without Ray): versions flip
only after every bucket, changed-only updates carry only what changed and still leave every
engine bitwise equal to the trainer, late workers are resynced, failed transports fall back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from miles.actors.policy_trainer import PolicyTrainer
from miles.actors.rollout_worker import RolloutWorker
from miles.actors.weight_broadcaster import WeightBroadcaster
from miles.buffers import BufferConfig, ReplayBuffer
from miles.rollout import GenerateContext, generate_single_turn
from miles.transports import ObjectStoreSender, TransportError, WeightUpdate, as_update
from miles.types import SamplingParams
from miles.transports.weights import pack_all, plan_buckets
from tests.unit.engines.helpers import make_engine, make_model


class Backend:
    """A trainer backend whose 'step' nudges every parameter not frozen."""

    def __init__(self) -> None:
        self.model = make_model(seed=3)
        self.version = 0
        self.gen = torch.Generator().manual_seed(0)

    def export_weights(self, bucket_bytes: int):
        yield from plan_buckets(((n, t.detach()) for n, t in self.model.state_dict().items()), bucket_bytes)

    def step(self, trainable: str = "") -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name.startswith(trainable):
                    p.add_(0.01 * torch.randn(p.shape, generator=self.gen))
        self.version += 1


def _worker(name: str) -> RolloutWorker:
    engine = make_engine(make_model(seed=1))
    ctx = GenerateContext(engine=engine, tokenizer=None, max_response_len=8, sampling=SamplingParams())
    return RolloutWorker(name, engine=engine, context=ctx, generate_fn=generate_single_turn,
                         buffer=ReplayBuffer(BufferConfig(n_samples_per_prompt=1)), partial_rollout=True)


def _same(worker: RolloutWorker, backend: Backend) -> bool:
    want = backend.model.state_dict()
    return all(torch.equal(v, want[k]) for k, v in worker.engine.model.state_dict().items())


def test_changed_only_updates_keep_engines_bitwise_equal() -> None:
    async def go() -> list[int]:
        backend = Backend()
        trainer = PolicyTrainer(backend, bucket_bytes=1 << 14, changed_only=True)
        bc = WeightBroadcaster()
        bc.attach_source(trainer)
        workers = {n: _worker(n) for n in ("w0", "w1")}
        for n, w in workers.items():
            bc.register(n, w)
        sizes = []
        for step in range(3):
            backend.step("model.layers.1.mlp" if step else "")
            version = await trainer.publish(bc)
            assert await bc.wait_applied(version, timeout=30)
            sizes.append(bc.latest_update.num_tensors)
            assert all(_same(w, backend) for w in workers.values()), step
        assert bc.latest_update.base_version == 2 and not bc.latest_update.full
        # A worker that joins now gets version 3 in full (republished), not the delta.
        late = _worker("late")
        bc.register("late", late)
        assert await bc.wait_applied(3, timeout=30)
        assert _same(late, backend) and trainer.counters["republishes"] == 1
        assert bc.latest()[0] == 3 and bc.latest()[1]  # the full republish is pullable
        return sizes

    sizes = asyncio.run(go())
    total = len(make_model().state_dict())
    assert sizes[0] == total and 0 < sizes[1] == sizes[2] < total  # only layer 1's MLP changed


def test_worker_rejects_a_delta_it_cannot_build_on() -> None:
    async def go() -> tuple[int, float]:
        worker = _worker("w")
        backend = Backend()
        plans = list(backend.export_weights(1 << 14))
        delta = ObjectStoreSender(use_ray=False).prepare(2, plans[:1], full=False, base_version=1)
        got = await worker.receive_weights(2, delta)  # the engine runs 0, not 1
        return got, worker.counters["weight_resyncs"]

    assert asyncio.run(go()) == (0, 1)


class FailingSender:
    kind = "cuda_ipc"

    def prepare(self, *args: Any, **kwargs: Any) -> WeightUpdate:
        raise TransportError("no GPU here")

    def close(self) -> None:
        self.closed = True


def test_a_failing_transport_falls_back_to_the_object_store() -> None:
    async def go() -> tuple[PolicyTrainer, RolloutWorker, Backend, WeightBroadcaster]:
        backend = Backend()
        sender = FailingSender()
        trainer = PolicyTrainer(backend, bucket_bytes=1 << 14, sender=sender)
        bc = WeightBroadcaster()
        worker = _worker("w0")
        bc.register("w0", worker)
        backend.step()
        await trainer.publish(bc)
        assert await bc.wait_applied(1, timeout=30)
        assert sender.closed
        return trainer, worker, backend, bc

    trainer, worker, backend, bc = asyncio.run(go())
    assert trainer.counters["fallbacks"] == 1 and "no GPU here" in trainer.last_error
    assert _same(worker, backend) and bc.latest_update.transport == "object_store"


class FakeWorker:
    def __init__(self) -> None:
        self.version = 0
        self.calls: list[int] = []

    async def receive_weights(self, version: int, update: Any) -> int:
        self.calls.append(version)
        self.version = max(self.version, version)
        return self.version


class FakeSource:
    def __init__(self) -> None:
        self.asked: list[int] = []

    async def republish(self, version: int) -> bool:
        self.asked.append(version)
        return True


def test_addressed_updates_skip_outsiders_and_ask_for_a_republish() -> None:
    async def go() -> tuple[FakeWorker, FakeWorker, FakeSource, WeightBroadcaster]:
        bc = WeightBroadcaster()
        source = FakeSource()
        bc.attach_source(source)
        a, b = FakeWorker(), FakeWorker()
        bc.register("a", a)
        plan = bc.plan_update(1)
        assert plan.members == ["a"] and plan.full and plan.regroup
        bc.register("b", b)  # joins after the plan: the IPC handles are not addressed to it
        await bc.publish(1, WeightUpdate(version=1, transport="cuda_ipc", buckets=[], members=["a"]))
        assert await bc.wait_delivered(1, ["a"], timeout=5)
        await asyncio.sleep(0.05)
        return a, b, source, bc

    a, b, source, bc = asyncio.run(go())
    assert a.calls == [1] and b.calls == [] and source.asked == [1]
    assert bc.needs_full == {"b"} and bc.plan_update(2).full
    assert bc.latest() == (1, [])  # IPC handles are not for pull consumers


def test_replayable_updates_reach_late_workers_and_versions_only_go_up() -> None:
    async def go() -> tuple[FakeWorker, WeightBroadcaster]:
        bc = WeightBroadcaster()
        await bc.publish(4, pack_all([("x", torch.zeros(2))], version=4, bucket_bytes=64))
        with pytest.raises(ValueError, match="not newer"):
            await bc.publish(4, [])
        late = FakeWorker()
        assert bc.register("late", late) == 4
        assert await bc.wait_applied(4, timeout=5)
        return late, bc

    late, bc = asyncio.run(go())
    assert late.calls == [4] and bc.needs_full == set()


def test_as_update_checks_the_version() -> None:
    update = as_update(2, pack_all([("x", torch.zeros(2))], version=2, bucket_bytes=64))
    assert update.transport == "object_store" and update.full and update.num_tensors == 1
    with pytest.raises(ValueError, match="version 2 delivered as version 3"):
        as_update(3, update)


def test_the_next_update_stages_while_the_previous_one_waits_for_its_drain() -> None:
    """Without partial rollouts a commit waits for in-flight generations; the next version
    must still stage meanwhile (a broadcast waits for every rank), and one swap then
    applies the newest."""

    async def go() -> tuple[list[int], RolloutWorker, Backend, list[tuple[int, int]]]:
        backend = Backend()
        worker = _worker("w0")
        drained = asyncio.Event()
        seen: list[tuple[int, int]] = []

        async def drain() -> None:  # in-flight generations that finish when the test says so
            await drained.wait()

        worker.inbox.drain = drain
        updates = []
        for version in (1, 2):
            backend.step()
            plans = list(backend.export_weights(1 << 14))
            updates.append(ObjectStoreSender(use_ray=False).prepare(version, plans))
        first = asyncio.create_task(worker.receive_weights(1, updates[0]))
        while worker.inbox.staged_version < 1:
            await asyncio.sleep(0.001)
        second = asyncio.create_task(worker.receive_weights(2, updates[1]))
        while worker.inbox.staged_version < 2:  # staged while version 1 waits for the drain
            await asyncio.sleep(0.001)
        seen.append((worker.engine.version, worker.inbox.staged_version))
        drained.set()
        return list(await asyncio.gather(first, second)), worker, backend, seen

    results, worker, backend, seen = asyncio.run(go())
    assert seen == [(0, 2)] and results == [2, 2]
    assert worker.counters["weight_updates"] == 1  # one swap applied both
    assert _same(worker, backend)


def test_train_steps_and_weight_export_run_on_the_trainers_one_compute_thread() -> None:
    """Every train step, export and pack runs on one thread of the trainer's own (one OpenMP
    team for its model work), not on asyncio's pool threads, and the event loop stays free."""
    import threading

    threads: list[tuple[str, int]] = []

    class Recording(Backend):
        def train_step(self, groups: Any) -> dict[str, float]:
            threads.append(("train", threading.get_ident()))
            self.step()
            return {"train/version": float(self.version)}

        def export_weights(self, bucket_bytes: int):
            threads.append(("export", threading.get_ident()))
            yield from super().export_weights(bucket_bytes)

    async def go() -> int:
        backend = Recording()
        trainer = PolicyTrainer(backend, bucket_bytes=1 << 14)
        bc = WeightBroadcaster()
        bc.attach_source(trainer)
        bc.register("w0", _worker("w0"))
        loop_thread = threading.get_ident()
        for _ in range(3):
            await asyncio.gather(*(asyncio.to_thread(sum, [1]) for _ in range(8)))  # busy pool threads
            await trainer.train([])
            assert await bc.wait_applied(await trainer.publish(bc), timeout=30)
        assert all(ident != loop_thread for _, ident in threads)
        return len({ident for _, ident in threads})

    assert asyncio.run(go()) == 1
    assert [kind for kind, _ in threads] == ["train", "export"] * 3


def test_a_train_call_sent_after_a_publish_waits_for_its_copy_even_when_it_starts_first() -> None:
    """The driver sends publish(v) and the next train(after=v) back to back and does not wait
    for the broadcaster; the train call may start first and must not move the weights before
    the publish has copied them, and the publish hands the copy on only once ``ready`` is."""

    class Stepping(Backend):
        def train_step(self, groups: Any) -> dict[str, float]:
            self.step()
            return {"train/version": float(self.version)}

    async def go() -> None:
        backend = Stepping()
        trainer = PolicyTrainer(backend, bucket_bytes=1 << 14)
        bc = WeightBroadcaster()
        bc.attach_source(trainer)
        worker = _worker("w0")
        bc.register("w0", worker)
        await trainer.train([])  # version 1
        want = {k: v.clone() for k, v in backend.model.state_dict().items()}
        known = asyncio.get_running_loop().create_future()  # the buffer's set_version, not answered yet
        train = asyncio.create_task(trainer.train([], after=1))  # starts before the publish
        await asyncio.sleep(0.01)
        assert backend.version == 1 and not train.done()  # waiting for the publish's copy
        publish = asyncio.create_task(trainer.publish(bc, [known]))
        await train  # trained on once the copy was made, while the publish waits for `known`
        assert backend.version == 2 and not publish.done() and bc.latest_version < 1
        known.set_result(None)
        assert await publish == 1
        assert await bc.wait_applied(1, timeout=30)
        got = worker.engine.model.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)  # version 1's weights, not version 2's
        with pytest.raises(ValueError, match="after=5"):
            await trainer.train([], after=5)

    asyncio.run(go())
