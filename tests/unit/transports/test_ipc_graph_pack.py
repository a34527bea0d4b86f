"""The CUDA IPC sender's pack as a CUDA graph, decided on the CPU: a full update's pack runs
eagerly the first time its signature (buffer, sources' addresses and shapes, wire dtype) is
seen, is captured the second time and replayed after that; anything else packs eagerly, and
a failed capture is not retried. The capture itself needs a GPU (tests/gpu/test_weights_gpu.py);
here a fake one stands in: its "graph" re-runs the captured pack, which reads the tensors it was
captured with, so a replay under a stale signature would show up as wrong bytes."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import pytest
import torch

from miles.transports import cuda_ipc
from miles.transports.base import IpcHandle
from miles.transports.cuda_ipc import POOL, CudaIpcSender, GraphPacker, source_signature
from miles.transports.weights import layout, views


class FakeCapture:
    """Records each capture; its replay re-runs the pack it captured (with that pack's tensors)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls = 0

    def __call__(self, run: Any) -> Any:
        self.calls += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        return run


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(4, 8, generator=g)), ("b", torch.randn(8, generator=g).to(torch.bfloat16)),
            ("ids", torch.arange(5)), ("t", torch.randn(3, 6, generator=g).t())]


def test_the_signature_changes_with_what_the_pack_reads_only() -> None:
    named = _named()
    sig = source_signature(named, torch.bfloat16)
    assert source_signature(named, torch.bfloat16) == sig
    with torch.no_grad():
        named[0][1].add_(1)  # in place: the same live tensor
    assert source_signature(named, torch.bfloat16) == sig
    assert source_signature(named, None) != sig  # another wire dtype
    renamed = [("z", named[0][1]), *named[1:]]
    assert source_signature(renamed, torch.bfloat16) != sig
    moved = [("a", named[0][1].clone()), *named[1:]]  # a new allocation
    assert source_signature(moved, torch.bfloat16) != sig
    base = named[0][1]
    for other in (base[1:], base.t(), base.view(8, 4), base.to(torch.float64)):  # offset, strides, shape, dtype
        assert source_signature([("a", other), *named[1:]], torch.bfloat16) != sig


def test_eager_first_captured_second_replayed_after() -> None:
    capture = FakeCapture()
    packer = GraphPacker(capture)
    packs: list[int] = []
    assert packer.pack(1000, ("sig",), lambda: packs.append(1)) == "eager"
    assert packer.pack(1000, ("sig",), lambda: packs.append(2)) == "captured"
    assert packer.pack(1000, ("sig",), lambda: packs.append(3)) == "replayed"
    assert packer.pack(1000, ("sig",), lambda: packs.append(4)) == "replayed"
    assert packs == [1, 2, 2, 2]  # later packs replay the captured one, their own run is not called
    assert (capture.calls, packer.captures, packer.replays, packer.eager) == (1, 1, 3, 1)


def test_a_new_signature_or_buffer_starts_over() -> None:
    capture = FakeCapture()
    packer = GraphPacker(capture)
    for _ in range(3):
        packer.pack(1000, ("sig",), lambda: None)
    assert packer.pack(1000, ("other",), lambda: None) == "eager"  # the buffer's graph is dropped
    assert packer.pack(1000, ("sig",), lambda: None) == "eager"  # ... so the old one starts over too
    assert packer.pack(1000, ("sig",), lambda: None) == "captured"
    assert packer.pack(2000, ("sig",), lambda: None) == "eager"  # another buffer
    assert packer.pack(2000, ("sig",), lambda: None) == "captured"
    assert packer.pack(1000, ("sig",), lambda: None) == "replayed"  # one graph per buffer
    assert capture.calls == 3


def test_a_failed_capture_packs_eagerly_and_is_not_retried(caplog: pytest.LogCaptureFixture) -> None:
    capture = FakeCapture(fail=True)
    packer = GraphPacker(capture)
    packs: list[int] = []
    with caplog.at_level(logging.DEBUG, logger="miles.transports.cuda_ipc"):
        for i in range(4):
            assert packer.pack(1000, ("sig",), lambda i=i: packs.append(i)) == "eager"
        packer.pack(1000, ("other",), lambda: None)
        packer.pack(1000, ("sig",), lambda: None)  # back to the failed signature: still no retry
        packer.pack(1000, ("sig",), lambda: None)
        assert capture.calls == 1 and packs == [0, 1, 2, 3]  # every update packed
        packer.pack(1000, ("other",), lambda: None)  # another signature may try (on its second sight)
        packer.pack(1000, ("other",), lambda: None)
        assert capture.calls == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "CUDA graph" in warnings[0].getMessage()
    assert packer.failures == 2 and packer.replays == 0


def test_a_failed_replay_packs_eagerly_and_drops_the_graph() -> None:
    packer = GraphPacker(lambda run: _raise)
    packs: list[int] = []
    packer.pack(1, ("s",), lambda: packs.append(0))
    assert packer.pack(1, ("s",), lambda: packs.append(1)) == "eager"
    assert packer.pack(1, ("s",), lambda: packs.append(2)) == "eager"
    assert packs == [0, 1, 2] and packer.failures == 1


def _raise() -> None:
    raise RuntimeError("graph launch failed")


def test_graphs_are_bounded_and_a_freed_buffer_forgets_its_own() -> None:
    packer = GraphPacker(FakeCapture(), keep=2)
    for buf in (1, 2, 3):
        packer.pack(buf, ("s",), lambda: None)
        packer.pack(buf, ("s",), lambda: None)
    assert packer.pack(1, ("s",), lambda: None) == "eager"  # the least recently packed lost its graph
    assert packer.pack(3, ("s",), lambda: None) == "replayed"
    packer.forget(3)
    assert packer.pack(3, ("s",), lambda: None) == "eager"


def test_layouts_are_reused_for_an_unchanged_source_signature() -> None:
    packer = GraphPacker(FakeCapture(), layouts=2)
    named = _named()
    sig = source_signature(named, torch.bfloat16)
    first = packer.layout(sig, named, torch.bfloat16)
    assert first == layout(named, torch.bfloat16)
    with torch.no_grad():
        named[0][1].mul_(2)
    again = packer.layout(source_signature(named, torch.bfloat16), named, torch.bfloat16)
    assert again is first and packer.layout_hits == 1  # the same list object: the slot views stay
    grown = [*named, ("c", torch.zeros(3))]
    assert packer.layout(source_signature(grown, torch.bfloat16), grown, torch.bfloat16)[1] > first[1]
    for i in range(2):  # bounded: the oldest go
        extra = [*named, (f"x{i}", torch.zeros(1))]
        packer.layout(source_signature(extra, torch.bfloat16), extra, torch.bfloat16)
    assert packer.layout(sig, named, torch.bfloat16) is not first


@pytest.fixture
def cpu_sender(monkeypatch: pytest.MonkeyPatch) -> CudaIpcSender:
    """A CudaIpcSender whose CUDA parts are faked: buffers on the host, a fake share and capture."""
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    monkeypatch.setattr(cuda_ipc, "gpu_uuid", lambda device: "GPU-fake")
    monkeypatch.setattr(cuda_ipc, "share", lambda buf: IpcHandle(0, b"h", buf.numel(), 0, b"r", 0, b"e", True))
    sender = CudaIpcSender("cuda", dtype=torch.bfloat16)
    sender.device = torch.device("cpu")
    sender.packer.capture = FakeCapture()
    return sender


def _packed(sender: CudaIpcSender, version: int, update: Any) -> dict[str, torch.Tensor]:
    return dict(views(sender.live[version].data, update.buckets[0].metas))


def _check(got: dict[str, torch.Tensor], named: list[tuple[str, torch.Tensor]]) -> None:
    for name, t in named:
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert torch.equal(got[name], want), name


def test_the_sender_replays_full_updates_of_live_tensors_and_packs_the_rest_eagerly(cpu_sender: CudaIpcSender) -> None:
    sender = cpu_sender
    named = _named()
    outcomes = []
    for version in range(1, 5):
        with torch.no_grad():
            named[0][1].add_(1)  # the trainer's step: same storages
        update = sender.prepare(version, [named], members=["w0"])
        _check(_packed(sender, version, update), named)
        outcomes.append((sender.packer.eager, sender.graph_captures, sender.graph_replays))
        sender.release(version)
    assert outcomes == [(1, 0, 0), (1, 1, 1), (1, 1, 2), (1, 1, 3)]
    assert sender.allocations == 1 and sender.packer.layout_hits == 3

    named[1] = ("b", named[1][1].clone() + 1)  # a parameter reallocated: eager, then a new capture
    for version in (5, 6):
        update = sender.prepare(version, [named], members=["w0"])
        _check(_packed(sender, version, update), named)
        sender.release(version)
    assert (sender.packer.eager, sender.graph_captures, sender.graph_replays) == (2, 2, 4)

    changed = named[:2]  # a changed-only update: a fresh buffer, packed eagerly
    update = sender.prepare(7, [changed], full=False, members=["w0"])
    _check(_packed(sender, 7, update), changed)
    update = sender.prepare(8, [changed], full=False, members=["w0"])
    assert sender.graph_replays == 4 and sender.graph_captures == 2


def test_the_switch_turns_graphs_off_and_freed_buffers_lose_theirs(cpu_sender: CudaIpcSender) -> None:
    sender = cpu_sender
    sender.graph_pack = False
    named = _named()
    for version in (1, 2, 3):
        update = sender.prepare(version, [named], members=["w0"])
        _check(_packed(sender, version, update), named)
        sender.release(version)
    assert sender.packer.capture.calls == 0 and sender.graph_replays == 0

    sender.graph_pack = True
    live = list(range(10, 11 + POOL))  # POOL + 1 full updates in flight: one buffer more than the pool keeps
    for version in live:
        sender.prepare(version, [named], members=["w0"])
    for version in live:
        sender.release(version)
    assert sender.allocations == POOL + 1 and len(sender.pool) == POOL
    kept = {buf.data.data_ptr() for buf in sender.pool}
    assert set(sender.packer._graphs) == kept  # the buffer dropped from the pool forgot its graph
