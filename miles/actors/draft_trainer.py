"""DraftTrainer: trains the speculative-decoding draft online, beside the policy trainer.

A plain class (``ray_actors`` wraps it). The driver hands it every trained batch with a
fire-and-forget ``add_batch`` (an object-store reference: no copy through the driver);
``run`` — a background loop, like a rollout worker's — trains on whatever has queued up
(``DraftLearner.train_on`` in a thread, so the actor keeps answering), and after every
``--draft-train-interval`` batches publishes a new draft version through its own
WeightBroadcaster: the *draft channel* (``WeightBroadcaster(method="receive_draft_weights")``),
whose deliveries workers apply to their engine's draft without touching policy versions.

Nothing waits on it: the driver never awaits ``add_batch``'s training, the policy trainer
never hears from it, and the queue drops its oldest trajectories (counted) when the draft
trainer falls behind. Its policy copy (hidden states for an EAGLE head, the teacher for
the KL term) is *pulled* from the policy broadcaster's ``latest()`` before each pass, so
it does not count as a worker the synchronous mode waits for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from miles.actors.handles import Peer
from miles.trainers.draft import DraftLearner, usable
from miles.types import Trajectory
from miles.utils.compute import ComputeThread
from miles.utils.proc import rss_mb
from miles.transports.weights import WeightBucket, pack_all, unpack

log = logging.getLogger(__name__)


async def apply_draft_buckets(engine: Any, version: int, buckets: Sequence[Any]) -> int:
    """Stage every bucket of draft ``version`` into ``engine``'s draft, then commit; returns
    the engine's draft version (older versions and engines without a draft are ignored)."""
    current = getattr(engine, "draft_version", -1)
    if current < 0 or version <= current:
        return current
    for ref in buckets:
        bucket: WeightBucket = ref if isinstance(ref, WeightBucket) else await ref
        if bucket.version != version:
            raise ValueError(f"draft bucket of version {bucket.version} in update {version}")
        engine.stage_draft_weights(unpack(bucket))
    await engine.commit_draft_weights(version)
    return engine.draft_version


class DraftTrainer:
    def __init__(self, learner: DraftLearner, *, draft_broadcaster: Any = None, policy_broadcaster: Any = None,
                 train_interval: int = 1, max_queue: int = 4096, bucket_bytes: int = 512 * 1024 * 1024,
                 use_object_store: bool = False, poll_interval_s: float = 0.05) -> None:
        self.learner = learner
        self.draft_broadcaster = Peer(draft_broadcaster) if draft_broadcaster is not None else None
        self.policy_broadcaster = Peer(policy_broadcaster) if policy_broadcaster is not None else None
        self.train_interval, self.bucket_bytes = train_interval, bucket_bytes
        self.use_object_store, self.poll_interval_s = use_object_store, poll_interval_s
        self.queue: deque[Trajectory] = deque()
        self.max_queue = max_queue
        self.batches_since_publish = 0
        self.pending_batches = 0
        self._stopping = False
        self._wake = asyncio.Event()
        self._compute = ComputeThread("miles-draft")  # model work on one thread (miles.utils.compute)
        self.last: dict[str, float] = {}
        self.counters = {"received": 0, "dropped": 0, "trained": 0, "passes": 0, "published": 0, "errors": 0,
                         "train_s": 0.0, "publish_s": 0.0}

    # ---- feeding ------------------------------------------------------------------------
    async def add_batch(self, batch: Sequence[Any]) -> int:
        """Queue fresh trajectories: a batch of groups or a flat list. Returns the queue size."""
        trajs = [t for item in batch for t in (item if isinstance(item, (list, tuple)) else [item])]
        trajs = [t for t in trajs if usable(t)]
        self.queue.extend(trajs)
        self.counters["received"] += len(trajs)
        while len(self.queue) > self.max_queue:
            self.queue.popleft()
            self.counters["dropped"] += 1
        self.pending_batches += 1
        self._wake.set()
        return len(self.queue)

    # ---- the loop -----------------------------------------------------------------------
    async def run(self) -> dict[str, float]:
        """Train on what arrives until ``stop``; publish every ``train_interval`` batches."""
        while not self._stopping:
            if not self.queue:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=self.poll_interval_s * 20)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                await self.train_pending()
            except Exception as exc:  # keep the loop alive: the draft is an optimisation
                self.counters["errors"] += 1
                log.exception("draft training pass failed: %s", exc)
                await asyncio.sleep(self.poll_interval_s)
        return self.ping()

    async def train_pending(self) -> dict[str, float]:
        """One pass over the queued trajectories (pulling newer policy weights first)."""
        await self._pull_policy()
        trajs = list(self.queue)
        self.queue.clear()
        batches, self.pending_batches = self.pending_batches, 0
        if not trajs:
            return {}
        t0 = time.monotonic()
        metrics = await self._compute.run(self.learner.train_on, trajs)
        self.counters["train_s"] += time.monotonic() - t0
        self.counters["trained"] += len(trajs)
        self.counters["passes"] += 1
        self.last = metrics
        self.batches_since_publish += max(batches, 1)
        if self.batches_since_publish >= self.train_interval:
            await self.publish()
        return metrics

    async def publish(self) -> int:
        """Hand the current draft weights, as version + 1, to the draft channel."""
        t0 = time.monotonic()
        version = self.learner.version + 1
        named = await self._compute.run(self.learner.export_weights)
        buckets: list[Any] = pack_all(named, version=version, bucket_bytes=self.bucket_bytes)
        if self.use_object_store:
            import ray

            buckets = [ray.put(b) for b in buckets]
        self.learner.version = version
        self.batches_since_publish = 0
        if self.draft_broadcaster is not None:
            await self.draft_broadcaster.call("publish", version, buckets)
        self.counters["published"] += 1
        self.counters["publish_s"] += time.monotonic() - t0
        return version

    async def _pull_policy(self) -> None:
        if self.policy_broadcaster is None or self.learner.policy is None:
            return
        version, refs = await self.policy_broadcaster.call("latest")
        if version <= self.learner.policy_version or not refs:
            return
        named = []
        for ref in refs:
            bucket: WeightBucket = ref if isinstance(ref, WeightBucket) else await ref
            named.extend(unpack(bucket))
        await self._compute.run(self.learner.load_policy_weights, named, version)

    async def stop(self) -> dict[str, float]:
        self._stopping = True
        self._wake.set()
        return self.ping()

    # ---- status and checkpoints ---------------------------------------------------------
    def ping(self) -> dict[str, float]:
        out = {f"draft/{k}": float(v) for k, v in self.counters.items()}
        out.update({k: float(v) for k, v in self.last.items()})
        out.update({"draft/version": float(self.learner.version), "draft/queue": float(len(self.queue)),
                    "draft/policy_version": float(self.learner.policy_version),
                    "draft/optimizer_steps": float(self.learner.steps), "mem/draft_trainer_rss_mb": rss_mb()})
        return out

    def get_version(self) -> int:
        return self.learner.version

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.learner.load_state_dict(state)
