"""Colocated weights by CUDA IPC: the engine maps the trainer's GPU buffers; no host round trip.

Sender (trainer, same GPU as the engines — ``--colocate``): the whole update is packed into
ONE GPU ``uint8`` buffer (cast to the engine's dtype in the same multi-tensor device copy;
``--update-weight-buffer-size`` does not split it: the buffer lives until every engine has
committed, so buckets would save no memory, and each handle costs the engine a mapping),
and for every addressed worker ``UntypedStorage._share_cuda_()`` yields an IPC handle. One share per
worker, because torch's cross-process reference counting gives each share one count that
its consumer returns when it lets go; the share also records an interprocess event after
the packing, which the consumer's stream waits on. Handles travel as plain data (bytes and
ints in an ``IpcHandle``; nothing is pickled). The buffers of a version are kept until every
addressee finished with it (``release``, called by the PolicyTrainer when the broadcaster
says so) — and even a buffer dropped earlier stays allocated while a consumer maps it
(torch's IPC "limbo").

Full updates reuse their buffers (a pool of ``POOL`` per sender, taken back on ``release``)
and receivers keep the last ``POOL`` full-update buffers mapped: torch opens an IPC handle
only when no live mapping of it exists in the process, so an update into a reused buffer
costs the engine no ``cudaIpcOpenMemHandle`` (a fixed cost per mapping that dominates a small
model's update when every update maps a fresh buffer).
Both sides also keep the per-tensor views of a reused buffer while its layout stays the
same: building them is host time before the copy can start and before staging, and it grows
with the number of tensors.
Reuse is safe because ``release`` comes after every addressee committed or discarded, and
a commit waits for its copies to finish on the device. Changed-only updates vary in size and
get fresh buffers, freed on release as before.

A full update's pack becomes a CUDA graph once it repeats. In the trainer the exported tensors
are live parameters (the same addresses, shapes and dtypes every update) and the pooled buffer
is the same too, so the pack launches the same copies every time; those launches are most of
the sender's ``prepare``, and a small model's pack is launch-bound on the device as well. So a
pack is keyed by a signature (the buffer;
each source's address, dtype, shape, strides and offset; the wire dtype): eager the first time,
captured the second (``GraphPacker``), one graph launch after that. A replay reads the sources
at the captured addresses, which is what an equal signature means; a new signature (a
parameter reallocated, a new buffer) packs eagerly again, and a signature whose capture failed
stays eager. Changed-only updates (fresh buffers, varying tensor sets) always pack eagerly. A
repeated signature also reuses its ``layout`` (the TensorMeta list). The share comes after the
replay on the same stream, so the event the engines wait on covers the graph's copies; a
replay into a buffer an engine still maps is the same case as an eager re-pack (see above).
As a graph the pack runs closer to the copy ceiling and the sender's ``prepare`` takes a
fraction of its eager host time (``benchmarks/weight_sync.py``). One caveat: while a capture runs, a random op
or a device-wide synchronize from another thread fails (the capture holds the device's default
generator, and a device sync would wait on the capturing stream), and the capture with it (the
pack then falls back to eager). Nothing in miles does that: the PolicyTrainer holds one lock
over training and publishing, and a capture happens once per pooled buffer.

Receiver (rollout worker): opens its handle on the GPU with the trainer's UUID (so differing
``CUDA_VISIBLE_DEVICES`` orders do not matter), views the bucket's tensors and stages them
*borrowed*: the trainer's buffer is the engine's staging area, and the commit is the one
copy into the parameters. A worker that will not apply an update still returns its counts.
Everything runs in a worker thread on the receiver's own stream, so the event waits never
touch the stream the engine decodes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from miles.transports.base import IpcBucket, IpcHandle, NamedTensors, Stage, TransportError, WeightUpdate
from miles.transports.weights import TensorMeta, layout, pack_into, slots, views

POOL = 2  # full-update buffers a sender keeps for reuse, and mappings a receiver keeps open

log = logging.getLogger(__name__)

Launch = Callable[[], None]  # a pack's launches, or a replay of them
Capture = Callable[[Launch], Launch]  # records a pack (without running it), returns its replay


def gpu_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``."""
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    raise TransportError(f"cuda_ipc: the trainer's GPU {uuid} is not visible in this process "
                         f"(CUDA_VISIBLE_DEVICES={_visible()}); cuda_ipc needs the trainer and the engine "
                         f"on the same GPU (--colocate); use --weight-transport nccl or object_store")


def _visible() -> str:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES", "<all>")


def share(buffer: torch.Tensor) -> IpcHandle:
    """One consumer's handle to ``buffer``'s storage (call once per consumer)."""
    return IpcHandle(*buffer.untyped_storage()._share_cuda_())


def open_handle(h: IpcHandle, device: int) -> torch.Tensor:
    """The shared buffer as a 1-D uint8 tensor on local ``device`` (waits for the trainer's
    packing on the current stream)."""
    storage = torch.UntypedStorage._new_shared_cuda(device, h.handle, h.size, h.offset, h.ref_counter,
                                                    h.ref_counter_offset, h.event, h.event_sync)
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage, 0, (h.size,), (1,))


def release_handle(h: IpcHandle) -> None:
    """Return a handle's count without mapping it (an update this worker will not apply)."""
    try:
        torch.UntypedStorage._release_ipc_counter_cuda(h.ref_counter, h.ref_counter_offset)
    except Exception:  # the trainer is gone: nothing left to return
        pass


def source_signature(tensors: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> tuple:
    """What a pack of ``tensors`` reads and how it lays them out: the wire dtype and, per tensor,
    its name, device, address, dtype, shape, strides and storage offset. Equal signatures mean
    an equal ``layout`` and, into the same buffer, the same copies from the same addresses, so a
    captured pack may be replayed. Holds no tensor (nothing stays allocated for it), and costs a
    few attribute reads per tensor, less than ``layout`` itself."""
    return (dtype, tuple((name, t.get_device(), t.data_ptr(), t.dtype, t.shape, t.stride(), t.storage_offset())
                         for name, t in tensors))


def capture_graph(run: Launch, stream: torch.cuda.Stream) -> Launch:
    """``run``'s launches recorded as a CUDA graph (not executed: call the result to replay them,
    on the then current stream). Capture needs a stream other than the default, hence
    ``stream``; ``thread_local`` because the sender runs in a worker thread while the trainer
    may use CUDA in others: the default ``global`` mode would turn their unsafe calls (a
    ``cudaMalloc``, say) into errors during the capture."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            run()
        finally:
            graph.capture_end()  # also after a failure: the stream must leave capture mode
    return graph.replay


@dataclass
class _Graph:
    signature: tuple  # (buffer bytes, source_signature)
    replay: Launch | None = None  # captured on the signature's second pack
    failed: bool = False  # its capture (or a replay) failed: eager for good


class GraphPacker:
    """Decides how a pack runs: eagerly, captured (then replayed once), or replayed; and keeps the
    layouts of recent source signatures. Bookkeeping only — ``capture`` does the CUDA part — so
    it is tested on the CPU with a fake one.

    Per destination buffer (its address): a signature's first pack runs eagerly, its second is
    captured and replayed, later ones replay. A new signature drops the buffer's graph and
    starts over. A capture that raises is logged (the first time), the pack runs eagerly, and
    that signature of that buffer is never captured again. At most ``keep`` buffers have a
    graph (the least recently packed lose theirs).
    """

    def __init__(self, capture: Capture, *, keep: int = 2 * POOL, layouts: int = 2 * POOL) -> None:
        self.capture = capture
        self.keep = keep
        self.layouts = layouts
        self._graphs: OrderedDict[int, _Graph] = OrderedDict()
        self._layouts: OrderedDict[tuple, tuple[list[TensorMeta], int]] = OrderedDict()
        self._failed: OrderedDict[tuple, None] = OrderedDict()  # (buffer, signature), bounded
        self.eager = self.captures = self.replays = self.failures = 0
        self.layout_hits = 0

    def layout(self, signature: tuple, tensors: Sequence[tuple[str, torch.Tensor]],
               dtype: torch.dtype | None) -> tuple[list[TensorMeta], int]:
        """``layout(tensors, dtype)``, reused for a ``source_signature`` seen recently (the same
        list object: the buffer's slot views are then kept without comparing metas)."""
        hit = self._layouts.get(signature)
        if hit is not None:
            self.layout_hits += 1
            self._layouts.move_to_end(signature)
            return hit
        hit = self._layouts[signature] = layout(tensors, dtype)
        while len(self._layouts) > self.layouts:
            self._layouts.popitem(last=False)
        return hit

    def pack(self, buffer: int, signature: tuple, run: Launch) -> str:
        """Pack into ``buffer`` (its address) by ``run`` or a replay of its capture; ``signature``:
        the buffer's size and the sources' ``source_signature``. Returns "eager", "captured"
        (captured, then replayed once) or "replayed"."""
        entry = self._graphs.get(buffer)
        if entry is None or entry.signature != signature:
            entry = _Graph(signature, failed=(buffer, signature) in self._failed)  # the old graph goes
            self._graphs[buffer] = entry
            self._graphs.move_to_end(buffer)
            while len(self._graphs) > self.keep:
                self._graphs.popitem(last=False)
            return self._eager(run)
        self._graphs.move_to_end(buffer)
        if entry.failed:
            return self._eager(run)
        outcome = "replayed"
        try:
            if entry.replay is None:
                entry.replay = self.capture(run)
                self.captures += 1
                outcome = "captured"
            entry.replay()
        except Exception as exc:  # never fail an update for the graph's sake: pack as before
            self._fail(buffer, entry, exc)
            return self._eager(run)
        self.replays += 1
        return outcome

    def _eager(self, run: Launch) -> str:
        run()
        self.eager += 1
        return "eager"

    def _fail(self, buffer: int, entry: _Graph, exc: Exception) -> None:
        (log.warning if not self.failures else log.debug)(
            "cuda_ipc: packing the update as a CUDA graph failed (%s: %s); this tensor set packs "
            "without one", type(exc).__name__, exc)
        self.failures += 1
        entry.failed, entry.replay = True, None
        self._failed[(buffer, entry.signature)] = None
        while len(self._failed) > 4 * self.keep:
            self._failed.popitem(last=False)

    def forget(self, buffer: int) -> None:
        """``buffer`` is freed: its graph goes (another buffer may get its address)."""
        self._graphs.pop(buffer, None)

    def clear(self) -> None:
        self._graphs.clear()
        self._layouts.clear()


@dataclass
class _Buffer:
    """A sender's update buffer, with the layout it was last packed in and the slot views of
    that layout (rebuilt only when a reused buffer gets another layout)."""

    data: torch.Tensor
    full: bool = True
    metas: list[TensorMeta] | None = None
    slots: list[torch.Tensor] | None = None


class CudaIpcSender:
    kind = "cuda_ipc"

    def __init__(self, device: torch.device | str, *, dtype: torch.dtype | None = None,
                 graph_pack: bool = True) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise TransportError(f"cuda_ipc needs the trainer on a GPU, not {self.device}")
        self.dtype = dtype
        self.live: dict[int, _Buffer] = {}  # version → its buffer
        self.pool: list[_Buffer] = []  # released full-update buffers, reused by size
        self.allocations = 0  # buffers allocated (a steady run of full updates stops at POOL + in flight)
        self.graph_pack = graph_pack  # False: every pack launches its copies (to compare)
        self.packer = GraphPacker(self._capture)
        self._stream: torch.cuda.Stream | None = None  # the capture stream, made on first use

    @property
    def graph_replays(self) -> int:
        """Full updates packed by one graph launch (the first one of a capture included)."""
        return self.packer.replays

    @property
    def graph_captures(self) -> int:
        return self.packer.captures

    def _capture(self, run: Launch) -> Launch:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return capture_graph(run, self._stream)

    def prepare(self, version: int, plans: Sequence[NamedTensors], *, full: bool = True, base_version: int = -1,
                members: Sequence[str] = ()) -> WeightUpdate:
        uuid = gpu_uuid(self.device)
        tensors = [item for plan in plans for item in plan]
        buckets = []
        with torch.cuda.device(self.device):
            signature = source_signature(tensors, self.dtype)
            metas, size = self.packer.layout(signature, tensors, self.dtype)
            buf = self._buffer(size, reuse=full)
            buf.full = full
            if buf.metas is not metas and buf.metas != metas:
                buf.metas, buf.slots = metas, slots(buf.data, metas)
            run = partial(pack_into, buf.data, tensors, metas, dsts=buf.slots)
            if full and size and self.graph_pack:  # a pooled buffer: the pack may repeat
                self.packer.pack(buf.data.data_ptr(), (size, signature), run)
            else:
                run()
            if size:  # the share records the event the engines wait on: after the packing
                buckets.append(IpcBucket(metas=metas, nbytes=size, gpu_uuid=uuid,
                                         handles={w: share(buf.data) for w in members}))
        self.live[version] = buf
        return WeightUpdate(version=version, transport="cuda_ipc", buckets=buckets, full=full,
                            base_version=base_version, members=list(members))

    def _buffer(self, size: int, *, reuse: bool) -> _Buffer:
        if reuse:
            for i, buf in enumerate(self.pool):
                if buf.data.numel() == size:
                    return self.pool.pop(i)
        self.allocations += 1
        return _Buffer(torch.empty(size, dtype=torch.uint8, device=self.device))

    def transfer(self, update: WeightUpdate) -> None:
        pass  # the engines map the buffers themselves

    def release(self, version: int) -> None:
        """Every addressee of ``version`` committed or discarded it: its buffer may be
        rewritten (full updates, into the pool) or freed."""
        buf = self.live.pop(version, None)
        if buf is None:
            return
        if buf.full and buf.data.numel():
            self.pool.append(buf)
            for gone in self.pool[:-POOL]:
                self.packer.forget(gone.data.data_ptr())
            self.pool = self.pool[-POOL:]
        torch.cuda.ipc_collect()  # dropped buffers whose consumers are done go back to the allocator

    @property
    def live_bytes(self) -> int:
        return sum(buf.data.numel() for buf in self.live.values())

    def close(self) -> None:
        for version in list(self.live):
            self.release(version)
        self.pool.clear()
        self.packer.clear()
        torch.cuda.ipc_collect()


class CudaIpcReceiver:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._streams: dict[int, Any] = {}
        # the last POOL full-update buffers, kept mapped so a reused one opens without a new
        # mapping, with the layout and named views of their last update
        self._mapped: OrderedDict[bytes, tuple[torch.Tensor, list[TensorMeta], NamedTensors]] = OrderedDict()

    async def receive(self, update: WeightUpdate, stage: Stage) -> int:
        return await asyncio.to_thread(self._receive, update, stage)

    def _receive(self, update: WeightUpdate, stage: Stage) -> int:
        mine = [b.handles.get(self.worker_id) for b in update.buckets]
        if any(h is None for b, h in zip(update.buckets, mine) if b.nbytes):
            for h in mine:
                if h is not None:
                    release_handle(h)
            raise TransportError(f"cuda_ipc update {update.version} carries no handle for {self.worker_id}")
        if not update.buckets:
            return 0
        device = local_index(update.buckets[0].gpu_uuid)
        stream = self._streams.setdefault(device, torch.cuda.Stream(device))
        staged = 0
        unused = 0  # handles from here on were neither mapped nor returned
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                for bucket, h in zip(update.buckets, mine):
                    named: NamedTensors | None = None
                    if h is not None:
                        flat = open_handle(h, device)
                        named = self._keep(h.handle, flat, bucket.metas) if update.full else views(flat, bucket.metas)
                    unused += 1
                    if named is not None:
                        staged += stage(named)
        except BaseException:
            for h in mine[unused:]:
                if h is not None:
                    release_handle(h)
            raise
        return staged

    def _keep(self, handle: bytes, flat: torch.Tensor, metas: list[TensorMeta]) -> NamedTensors:
        """Keep ``flat`` mapped (the older storage of this handle goes, returning its count);
        returns its named views, reused while the handle's storage and layout are the same."""
        old = self._mapped.get(handle)
        ptr = flat.untyped_storage().data_ptr()
        same = old is not None and old[1] == metas and old[0].untyped_storage().data_ptr() == ptr
        # reused views keep the first storage object of this mapping alive as well (one more
        # count, returned with the rest when the handle leaves the POOL kept here)
        named = old[2] if same else views(flat, metas)
        self._mapped[handle] = (flat, metas, named)
        self._mapped.move_to_end(handle)
        while len(self._mapped) > POOL:
            self._mapped.popitem(last=False)
        return named

    def discard(self, update: WeightUpdate) -> None:
        """Return this worker's counts of an update it will not apply."""
        for b in update.buckets:
            h = b.handles.get(self.worker_id)
            if h is not None:
                release_handle(h)
