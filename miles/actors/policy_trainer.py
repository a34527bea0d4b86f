"""PolicyTrainer: wraps a trainer backend; trains a batch, then publishes version v+1.

The driver hands it whole groups from the buffer (as soon as a batch satisfies the
staleness bound). The backend's step runs on the trainer's one compute thread so the actor
keeps answering health checks. ``publish`` exports HF-named weights in buckets of
``--update-weight-buffer-size`` bytes and sends them with its ``WeightSender``
(``miles.transports``: object store, NCCL / gloo broadcast, CUDA IPC):

1. ask the broadcaster for the plan (who receives; rebuild the distributed group? must this
   update be full?); rebuild the group if needed (members join while the trainer does);
2. with ``--weight-update-changed-only``, keep only the tensors whose fingerprint changed;
3. ``prepare`` (pack / put / share), hand the update to the broadcaster (it starts the
   deliveries), then ``transfer`` (the broadcasts, while the workers receive);
4. CUDA IPC buffers are freed once every addressee is done with them.

Workers on other nodes than the trainer's (the plan's ``remote``) get each version of a group
transport through the object store, from the same export, once the broadcast is done.

If a GPU transport fails (a peer died mid-broadcast, a rendezvous timed out), the same
version goes out through the object store instead and the next publish rebuilds the group.
``republish`` (asked by the broadcaster for a worker that needs the newest version in full)
sends the current version through the object store. Training, publishing and republishing
hold one lock, so weights are never exported halfway through an optimizer step.

An object-store update is a copy of the weights: such a publish holds the lock only while it
packs them, and the next step trains while the broadcaster is told. ``train(after=v)`` waits
for the publish of version v to have read the weights: the driver sends the publish and the
next train call back to back, and an actor's async calls need not start in submission order.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from miles.actors.handles import Peer
from miles.protocols import TrainerBackend
from miles.transports import ChangeTracker, ObjectStoreSender, UpdatePlan, WeightUpdate
from miles.types import Trajectory
from miles.utils.compute import ComputeThread
from miles.utils.proc import rss_mb

log = logging.getLogger(__name__)


class PolicyTrainer:
    def __init__(self, backend: TrainerBackend, *, bucket_bytes: int, use_object_store: bool = False,
                 deterministic: bool = False, sender: Any = None, changed_only: bool = False,
                 wire_dtype: torch.dtype | None = None, release_timeout_s: float = 600.0) -> None:
        self.backend = backend
        self.deterministic = deterministic
        self.bucket_bytes = bucket_bytes
        self.use_object_store = use_object_store
        self.sender = sender or ObjectStoreSender(use_ray=use_object_store, dtype=wire_dtype)
        # Full object-store updates: when a GPU transport fails, for late joiners, and when
        # there is nobody to address yet (a distinct instance: ``sender is self.fallback``
        # means "falling back").
        self.fallback = ObjectStoreSender(use_ray=use_object_store, dtype=wire_dtype)
        self.tracker = ChangeTracker() if changed_only else None
        self.release_timeout_s = release_timeout_s
        self.published_version = -1
        self.replayable_version = -1  # newest version published in full through the object store
        self.last_publish_s = 0.0
        self.init_s = 0.0  # construction seconds (set by the Ray actor that builds the backend)
        self.counters = {"publishes": 0, "fallbacks": 0, "republishes": 0, "remote_publishes": 0, "bytes_sent": 0,
                         "tensors_sent": 0}
        self.last_error = ""
        self._broadcaster: Peer | None = None
        self.read_version = -1  # newest version a publish has read the weights of
        self._lock: asyncio.Lock | None = None
        self._read: asyncio.Condition | None = None
        self._delivering: asyncio.Lock | None = None
        self._releases: set[asyncio.Task[None]] = set()
        self._compute = ComputeThread("miles-trainer")  # model work on one thread (miles.utils.compute)

    @property
    def version(self) -> int:
        return self.backend.version

    def get_version(self) -> int:
        return self.backend.version

    def _weights_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _read_condition(self) -> asyncio.Condition:
        if self._read is None:
            self._read = asyncio.Condition()
        return self._read

    def _delivery_lock(self) -> asyncio.Lock:
        """Held from an update's copy to the broadcaster's answer: updates reach it in version order."""
        if self._delivering is None:
            self._delivering = asyncio.Lock()
        return self._delivering

    async def _mark_read(self, version: int) -> None:
        cond = self._read_condition()
        async with cond:
            self.read_version = max(self.read_version, version)
            cond.notify_all()

    async def train(self, groups: Sequence[Sequence[Trajectory]], after: int | None = None) -> dict[str, float]:
        """One optimizer step on ``groups``. ``after``: a version whose publish must read the
        weights before this step moves them (the one the driver asked to publish last)."""
        start = time.monotonic()
        if after is not None:
            if after > self.backend.version:
                raise ValueError(f"after={after}: the trainer is at version {self.backend.version}")
            cond = self._read_condition()
            async with cond:
                await cond.wait_for(lambda: self.read_version >= after or self.backend.version > after)
        if self.deterministic:
            # Groups arrive in completion order, which depends on timing; a fixed order
            # makes the gradient's summation order, hence the weights, reproducible.
            groups = sorted((sorted(g, key=lambda t: t.index_in_group) for g in groups),
                            key=lambda g: g[0].group_id)
        async with self._weights_lock():
            metrics = await self._compute.run(self.backend.train_step, groups)
        metrics = dict(metrics)
        metrics["perf/train_step_s"] = time.monotonic() - start
        return metrics

    async def publish(self, broadcaster: Any, ready: Sequence[Any] = ()) -> int:
        """Send the current weights to the broadcaster's workers; returns the version.
        ``ready``: awaitables (Ray references) to wait for before any worker may receive the
        weights, such as the buffer learning the version; passed in a list so that the call
        starts, and reads the weights, without waiting for them."""
        peer = self._broadcaster = Peer(broadcaster)
        if self.sender.kind == "object_store" and self.tracker is None:
            return await self._publish_copy(peer, ready)
        async with self._weights_lock():
            start = time.monotonic()
            version = self.backend.version
            try:
                await self._publish_locked(peer, version, ready)
            finally:
                await self._mark_read(version)
            self.last_publish_s = time.monotonic() - start
        return version

    async def _publish_copy(self, peer: Peer, ready: Sequence[Any]) -> int:
        """A full object-store update: every member gets the same copy, so the broadcaster's
        plan changes nothing and is not asked; the lock covers the copy only."""
        deliveries = self._delivery_lock()
        async with self._weights_lock():
            start = time.monotonic()
            version = self.backend.version
            try:
                plans, _ = await self._compute.run(self._export, True)
                update: WeightUpdate = await self._compute.run(self.sender.prepare, version, plans, full=True)
            finally:
                await self._mark_read(version)
            await deliveries.acquire()
        try:
            await asyncio.gather(*ready)
            await peer.call("publish", version, update, False)
        finally:
            deliveries.release()
        self._note_sent(version, [update])
        self.published_version = version  # deliveries go in version order (the delivery lock)
        self.counters["publishes"] += 1
        self.last_publish_s = time.monotonic() - start
        return version

    async def _publish_locked(self, peer: Peer, version: int, ready: Sequence[Any]) -> None:
        """A publish through a transport that reads the weights while it sends them (NCCL,
        CUDA IPC) or that sends what changed since the last one: all under the lock."""
        await asyncio.gather(*ready)
        plan: UpdatePlan = await peer.call("plan_update", version)
        sender = self.sender if plan.members else self.fallback  # nobody to address (yet, or on this node)
        try:
            await self._send(peer, sender, version, plan)
        except Exception as exc:
            if sender.kind == "object_store":
                raise
            self.counters["fallbacks"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("weight transport %s failed for version %d (%s); sending it through the "
                        "object store", sender.kind, version, self.last_error)
            sender.close()
            await peer.call("group_failed")
            await self._send(peer, self.fallback, version, plan, replace=True)
        self.published_version = version
        self.counters["publishes"] += 1

    async def republish(self, version: int) -> bool:
        """Publish ``version`` again, in full, through the object store (for workers that
        joined late or missed it). False when the weights have moved on or it already is."""
        if self._broadcaster is None:
            return False
        async with self._weights_lock():
            if version != self.published_version or version != self.backend.version:
                return False  # trained further: the next publish reaches everyone
            if version == self.replayable_version:
                return False
            plan = UpdatePlan(members=[], full=True, regroup=False)
            await self._send(self._broadcaster, self.fallback, version, plan, replace=True)
            self.counters["republishes"] += 1
            return True

    async def _send(self, peer: Peer, sender: Any, version: int, plan: UpdatePlan, *, replace: bool = False) -> None:
        if sender.kind == "distributed" and (plan.regroup or not sender.ready):
            spec = sender.new_spec(world_size=1 + len(plan.members))
            await peer.call("form_group", spec, plan.members)
            await asyncio.to_thread(sender.join, spec)
        tracker = self.tracker
        full = tracker is None or plan.full or tracker.version < 0 or sender is self.fallback
        plans, prints = await self._compute.run(self._export, full)
        base = tracker.version if tracker is not None and not full else -1
        members = plan.members if sender.kind != "object_store" else []
        update: WeightUpdate = await self._compute.run(sender.prepare, version, plans, full=full,
                                                      base_version=base, members=members)
        await peer.call("publish", version, update, replace)
        try:
            await asyncio.to_thread(sender.transfer, update)
        finally:
            if sender.kind == "cuda_ipc":
                self._spawn_release(peer, sender, update)
        sent = [update]
        if plan.remote and sender.kind != "object_store":  # the other nodes' workers: the same version
            update = await self._compute.run(self.fallback.prepare, version, plans, full=full,
                                             base_version=base, members=[])
            await peer.call("publish", version, update, True)
            self.counters["remote_publishes"] += 1
            sent.append(update)
        if tracker is not None:
            tracker.commit(version, prints)
        self._note_sent(version, sent)

    def _note_sent(self, version: int, sent: Sequence[WeightUpdate]) -> None:
        """The counters, and the version a late worker can be replayed, once the updates of
        ``version`` reached the broadcaster (the last one decides what is replayable)."""
        if sent[-1].replayable:
            self.replayable_version = version
        self.counters["bytes_sent"] += sum(u.nbytes for u in sent)
        self.counters["tensors_sent"] += sum(u.num_tensors for u in sent)

    def _export(self, full: bool) -> tuple[list[Any], dict[str, Any]]:
        plans = list(self.backend.export_weights(self.bucket_bytes))
        if self.tracker is None:
            return plans, {}
        return self.tracker.select(plans, full=full)

    def _spawn_release(self, peer: Peer, sender: Any, update: WeightUpdate) -> None:
        async def release() -> None:
            try:
                await peer.call("wait_delivered", update.version, update.members, self.release_timeout_s)
            finally:
                sender.release(update.version)

        task = asyncio.ensure_future(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def export_hf(self, path: str, base_checkpoint: str) -> str:
        """Write the current policy as a Hugging Face checkpoint: the HF-named tensors the
        broadcaster ships, plus config and tokenizer files copied from ``base_checkpoint``
        (so ``--hf-checkpoint path`` and transformers both load it). A quantized policy
        (``--quantization``) also gets its quantized export beside it, ``PATH-fp8`` or
        ``PATH-int4`` (``miles.models.quant_io``; ``load_pretrained`` reads it back)."""
        from safetensors.torch import save_file

        from miles.models.quant import spec_of
        from miles.models.quant_io import save_quantized
        from miles.trainers.state import named_weights

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        model = getattr(self.backend, "model", None)
        spec = spec_of(model) if model is not None else None
        if spec is not None:  # the master weights, not the quantized wire form
            named = named_weights(model)
        elif getattr(self.backend, "lora", False):  # the adapters merged in: a plain HF checkpoint
            named = (item for bucket in self.backend.export_merged(1 << 30) for item in bucket)
        else:
            named = (item for bucket in self.backend.export_weights(1 << 30) for item in bucket)
        tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in named}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "miles_version": str(self.version)})
        dirs = [out]
        if spec is not None:
            dirs.append(save_quantized(model, f"{out}-{spec.kind}", spec))
        for f in Path(base_checkpoint).iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
                for d in dirs:
                    if not (d is not out and f.name == "config.json"):
                        shutil.copy2(f, d / f.name)
        return str(out)

    def ping(self) -> dict[str, float]:
        out = {"train/version": float(self.backend.version), "perf/publish_s": self.last_publish_s,
               "perf/trainer_init_s": self.init_s, "mem/trainer_rss_mb": rss_mb()}
        out.update({f"weights/{k}": float(v) for k, v in self.counters.items()})
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.backend.state_dict()

    def base_offer(self) -> Any:
        """For a colocated engine process: IPC handles to a LoRA trainer's frozen base, or why
        not (``miles.engines.shared.offer``); call once per engine process."""
        from miles.engines.shared import offer

        return offer(self.backend)

    def save_adapter(self, path: str, base_checkpoint: str | None = None) -> str | None:
        """A LoRA policy's adapters in PEFT's format at ``path``; None for full-parameter training."""
        if not getattr(self.backend, "lora", False):
            return None
        return self.backend.save_adapter(path, base_checkpoint)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.backend.load_state_dict(state)
        if self.tracker is not None:
            self.tracker.reset()  # the engines will need every tensor of the loaded weights
