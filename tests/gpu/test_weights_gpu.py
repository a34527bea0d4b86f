"""Weight transports on CUDA: a CUDA IPC round trip leaves the engine's weights bitwise equal
to the trainer's (full and changed-only updates); the engine keeps decoding while an update
stages and only the commit pauses it (its pause is measured); NCCL broadcast between two
GPUs (skipped with fewer). The trainer and the engine are separate processes, as in a run
(a process cannot map its own IPC handles)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.engines import EmbeddedEngine, EngineConfig  # noqa: E402
from miles.engines.weights import WeightStager  # noqa: E402
from miles.models import CausalLM, tiny_config  # noqa: E402
from miles.transports import make_receiver, make_sender  # noqa: E402
from miles.transports.changed import ChangeTracker, fingerprints  # noqa: E402
from miles.types import GenerateRequest, SamplingParams  # noqa: E402
from miles.weights import plan_buckets  # noqa: E402

TIMEOUT = 120


def _model(seed: int) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(tiny_config(initializer_range=0.1)).eval()


def _ipc_engine(inbox: Any, outbox: Any) -> None:
    """The engine process: apply each IPC update it is sent, reply with its weights."""
    engine = EmbeddedEngine(_model(seed=1), config=EngineConfig(device="cuda", dtype="bfloat16", max_seq_len=128))
    receiver = make_receiver("cuda_ipc", worker_id="w0", device="cuda")

    async def apply(update: Any) -> int:
        n = await receiver.receive(update, lambda named: engine.stage_weights(named, borrow=True))
        await engine.commit_weights(update.version)
        return n

    while (update := inbox.get()) is not None:
        try:
            n = asyncio.run(apply(update))
            outbox.put((n, engine.version, {k: v.cpu() for k, v in engine.model.state_dict().items()}))
        except Exception as exc:
            outbox.put(exc)


def test_cuda_ipc_round_trip_is_bitwise() -> None:
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_engine, args=(inbox, outbox), daemon=True)
    proc.start()
    sender = make_sender("cuda_ipc", device="cuda", dtype=torch.bfloat16)
    trainer = _model(seed=2).cuda()  # float32 master weights; bf16 on the wire
    tracker = ChangeTracker()
    try:
        # full, changed-only, then two full updates into the first one's buffer (reused: the
        # engine keeps it mapped, so what it reads must be the new version's bytes)
        for version in (1, 2, 3, 4):
            if version > 1:
                with torch.no_grad():
                    trainer.model.layers[0].mlp.down_proj.weight.add_(0.5)  # one tensor changes
            plans = list(plan_buckets(trainer.state_dict().items(), 1 << 14))
            full = version != 2
            kept, prints = tracker.select(plans, full=full)
            update = sender.prepare(version, kept, full=full, base_version=tracker.version, members=["w0"])
            inbox.put(update)
            got = outbox.get(timeout=TIMEOUT)
            assert not isinstance(got, Exception), got
            n, engine_version, weights = got
            tracker.commit(version, prints)
            sender.release(version)
            assert engine_version == version
            assert n == (len(trainer.state_dict()) if full else 1)
            for name, t in trainer.state_dict().items():
                assert torch.equal(weights[name], t.to(torch.bfloat16).cpu()), (version, name)
        assert sender.allocations == 2  # versions 3 and 4 reused version 1's buffer
    finally:
        inbox.put(None)
        proc.join(timeout=TIMEOUT)
        sender.close()


def test_staging_does_not_stop_decoding_and_the_commit_pause_is_measured() -> None:
    engine = EmbeddedEngine(_model(seed=1), config=EngineConfig(device="cuda", dtype="bfloat16", max_seq_len=512))
    target = {k: v.to("cuda", torch.bfloat16) for k, v in _model(seed=3).state_dict().items()}
    arrived = threading.Event()

    def arriving():
        items = list(target.items())
        yield from items[:-1]
        assert arrived.wait(TIMEOUT)
        yield items[-1]

    async def scenario() -> tuple[int, Any]:
        req = GenerateRequest(rid="r", input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=400, ignore_eos=True))
        gen = asyncio.create_task(engine.generate(req))
        while (engine.progress("r") or 0) < 3:
            await asyncio.sleep(0.005)
        staging = asyncio.create_task(asyncio.to_thread(engine.stage_weights, arriving(), borrow=True))
        start = engine.progress("r")
        for _ in range(int(TIMEOUT / 0.005)):
            if engine.progress("r") >= start + 10:
                break
            await asyncio.sleep(0.005)
        moved = engine.progress("r") - start
        arrived.set()
        await staging
        await engine.commit_weights(7)
        out = await gen
        await engine.close()
        return moved, out

    moved, out = asyncio.run(scenario())
    assert moved >= 10  # decoded while a staging call was in progress
    assert out.versions[0] == 0 and out.versions[-1] == 7
    stats = engine.stats()
    assert stats["engine/swap_pause_s_max"] > 0 and stats["engine/weight_updates"] == 1
    for name, t in engine.model.state_dict().items():
        assert torch.equal(t, target[name]), name


def test_borrowed_cuda_tensors_are_checked_at_the_commit() -> None:
    params = {"a": torch.zeros(64, device="cuda", dtype=torch.bfloat16)}
    stager = WeightStager(params, torch.device("cuda"), torch.bfloat16)
    bad = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    bad[9] = float("inf")
    stager.stage([("a", bad)], borrow=True)
    assert stager.staged["a"] is bad
    with pytest.raises(ValueError, match="non-finite"):
        stager.apply()
    assert torch.equal(params["a"], torch.zeros_like(params["a"]))


def _nccl_engine(spec: Any, shapes: list, outbox: Any, inbox: Any) -> None:
    torch.cuda.set_device(1)
    params = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda:1") for n, s in shapes}
    stager = WeightStager(params, torch.device("cuda:1"), torch.bfloat16)
    receiver = make_receiver("distributed", worker_id="w0", device="cuda:1")
    receiver.join(spec, 1)
    update = inbox.get()
    n = asyncio.run(receiver.receive(update, lambda named: stager.stage(named, borrow=True)))
    stager.apply()
    outbox.put((n, fingerprints(list(params.items()))))
    receiver.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one rank per GPU)")
def test_nccl_broadcast_between_two_gpus_is_bitwise() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    named = [(f"w{i}", torch.randn(300 + i, 129, generator=g, device="cuda:0")) for i in range(20)]
    sender = make_sender("nccl", device="cuda:0", dtype=torch.bfloat16, timeout_s=TIMEOUT)
    spec = sender.new_spec(2)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    shapes = [(n, tuple(t.shape)) for n, t in named]
    proc = ctx.Process(target=_nccl_engine, args=(spec, shapes, outbox, inbox), daemon=True)
    proc.start()
    try:
        sender.join(spec)
        update = sender.prepare(1, list(plan_buckets(named, 1 << 18)), members=["w0"])
        assert len(update.buckets) > 2  # packing the next bucket overlaps the broadcast
        inbox.put(update)
        sender.transfer(update)
        n, prints = outbox.get(timeout=TIMEOUT)
    finally:
        sender.close()
        proc.join(timeout=TIMEOUT)
    assert n == len(named)
    assert prints == fingerprints([(k, t.to(torch.bfloat16)) for k, t in named])
