"""Weight transports on CUDA: a CUDA IPC round trip leaves the engine's weights bitwise equal
to the trainer's (full and changed-only updates); the engine keeps decoding while an update
stages and only the commit pauses it (its pause is measured); NCCL broadcast between two
GPUs (skipped with fewer). The trainer and the engine are separate processes, as in a run
(a process cannot map its own IPC handles). The CUDA IPC sender's pack as a CUDA graph: the
engine gets the live parameters' current bytes from its replays; every copy path of the pack
captures, also while other threads use CUDA; a failed capture falls back to eager packing."""

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
from miles.transports.weights import plan_buckets  # noqa: E402

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


# ---- the CUDA IPC sender's pack as a CUDA graph ------------------------------------------
def test_cuda_ipc_graph_pack_replays_the_live_parameters_bitwise() -> None:
    """From a pooled buffer's second full update on, the pack is one CUDA graph replay: the
    engine must still get each update's bytes (the parameters change in place between
    updates), and after a parameter is reallocated its new bytes (an eager pack, then a new
    capture)."""
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_engine, args=(inbox, outbox), daemon=True)
    proc.start()
    sender = make_sender("cuda_ipc", device="cuda", dtype=torch.bfloat16)
    trainer = _model(seed=2).cuda()
    layer = trainer.model.layers[0].mlp.down_proj
    counts = []
    try:
        for version in range(1, 8):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.01 * version)  # an optimizer step: the same storages
                if version == 5:
                    layer.weight = torch.nn.Parameter(layer.weight.detach() + 0.5)  # a new allocation
            plans = list(plan_buckets(trainer.state_dict().items(), 1 << 14))
            update = sender.prepare(version, plans, members=["w0"])
            inbox.put(update)
            got = outbox.get(timeout=TIMEOUT)
            assert not isinstance(got, Exception), got
            _, engine_version, weights = got
            sender.release(version)
            assert engine_version == version
            for name, t in trainer.state_dict().items():
                assert torch.equal(weights[name], t.to(torch.bfloat16).cpu()), (version, name)
            counts.append((sender.graph_captures, sender.graph_replays))
        # eager, captured, replayed ×2; the reallocation: eager, captured, replayed
        assert counts == [(0, 0), (1, 1), (1, 2), (1, 3), (1, 3), (2, 4), (2, 5)]
        assert sender.allocations == 1 and sender.packer.failures == 0
    finally:
        inbox.put(None)
        proc.join(timeout=TIMEOUT)
        sender.close()


def _every_copy_path() -> list[tuple[str, torch.Tensor]]:
    """Sources for each way pack_into copies: a plain memcpy (≥ MEMCPY_BYTES, same dtype), casts
    and small tensors in the multi-tensor copy, a strided view, integers and booleans; plus
    many small ones, so that a capture takes long enough to overlap other threads' CUDA calls."""
    g = torch.Generator(device="cuda").manual_seed(0)
    named = [("big", torch.randn(4096, 2048, generator=g, device="cuda").to(torch.bfloat16)),
             ("cast", torch.randn(300, 129, generator=g, device="cuda")),
             ("strided", torch.randn(64, 96, generator=g, device="cuda").to(torch.bfloat16).t()),
             ("ids", torch.arange(1000, device="cuda")),
             ("mask", torch.rand(77, generator=g, device="cuda") > 0.5)]
    return named + [(f"small{i}", torch.randn(17 + i, generator=g, device="cuda")) for i in range(300)]


def _step(named: list[tuple[str, torch.Tensor]]) -> None:
    with torch.no_grad():
        for _, t in named:
            if t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.add_(1)


def _assert_packed(sender: Any, version: int, update: Any, named: list[tuple[str, torch.Tensor]]) -> None:
    from miles.transports.weights import views

    got = dict(views(sender.live[version].data, update.buckets[0].metas))
    for name, t in named:
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert torch.equal(got[name], want), (version, name)


def test_graph_pack_copies_every_path_and_captures_while_other_threads_use_cuda() -> None:
    """The prepare runs in a worker thread, as in the trainer, while another thread allocates,
    computes and synchronizes: a capture in ``global`` mode would fail (or fail them)."""
    from miles.transports.cuda_ipc import CudaIpcSender

    named = _every_copy_path()
    sender = CudaIpcSender("cuda", dtype=torch.bfloat16)
    done, errors = threading.Event(), []

    def trainer() -> None:
        try:
            n = 0
            while not done.is_set():
                n += 1
                # new sizes: fresh allocations, and kernels on this thread's stream. No RNG op
                # and no device-wide synchronize here: a capture puts the device's default
                # generator in capture mode, and cudaDeviceSynchronize would wait on the
                # capturing stream, so either fails (the PolicyTrainer never trains while it
                # publishes: one lock serializes them)
                x = torch.ones(256 + n % 64, 512, device="cuda") / (n % 7 + 1)
                (x @ x.t()).sum()
        except Exception as exc:  # reported below
            errors.append(exc)

    def publish() -> None:
        try:
            version = 0
            for round_ in range(6):
                if round_:
                    named[1] = ("cast", named[1][1].clone())  # a new signature: eager, captured, replayed
                for _ in range(3):
                    version += 1
                    _step(named)
                    update = sender.prepare(version, [named])
                    _assert_packed(sender, version, update, named)
                    sender.release(version)
            published.append(version)
        except Exception as exc:  # reported below
            published.append(exc)

    published: list[Any] = []
    worker = threading.Thread(target=trainer, daemon=True)
    worker.start()
    try:
        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        publisher.join(TIMEOUT)
    finally:
        done.set()
        worker.join(TIMEOUT)
        sender.close()
    assert published == [18] and not errors, (published, errors)
    assert (sender.graph_captures, sender.graph_replays, sender.packer.failures) == (6, 12, 0)


def test_a_failed_capture_packs_eagerly_and_later_captures_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pack that cannot be captured (here: it synchronizes) is packed eagerly and never
    captured again; a later signature captures normally."""
    from miles.transports import cuda_ipc

    pack_into = cuda_ipc.pack_into

    def syncing(*args: Any, **kwargs: Any) -> None:
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed while capturing: the capture fails
        pack_into(*args, **kwargs)

    monkeypatch.setattr(cuda_ipc, "pack_into", syncing)
    named = _every_copy_path()[:5]
    sender = cuda_ipc.CudaIpcSender("cuda", dtype=torch.bfloat16)
    try:
        for version in (1, 2, 3):
            _step(named)
            update = sender.prepare(version, [named])
            _assert_packed(sender, version, update, named)
            sender.release(version)
        assert (sender.graph_captures, sender.packer.failures) == (0, 1)
        monkeypatch.setattr(cuda_ipc, "pack_into", pack_into)
        named[0] = ("big", named[0][1].clone())
        for version in (4, 5, 6):
            _step(named)
            update = sender.prepare(version, [named])
            _assert_packed(sender, version, update, named)
            sender.release(version)
        assert (sender.graph_captures, sender.graph_replays, sender.packer.failures) == (1, 2, 1)
    finally:
        sender.close()
