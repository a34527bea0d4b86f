"""PolicyTrainer: wraps a trainer backend; trains a batch, then publishes version v+1.

The driver hands it whole groups from the buffer (as soon as a batch satisfies the
staleness bound). The backend's step runs in a thread so the actor keeps answering health
checks. ``publish`` exports HF-named weights in buckets of ``--update-weight-buffer-size``
bytes, puts each into the object store (Ray) and gives the references to the broadcaster.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from miles.actors.handles import Peer
from miles.protocols import TrainerBackend
from miles.types import Trajectory
from miles.utils.proc import rss_mb
from miles.weights import pack


class PolicyTrainer:
    def __init__(self, backend: TrainerBackend, *, bucket_bytes: int, use_object_store: bool = False,
                 deterministic: bool = False) -> None:
        self.backend = backend
        self.deterministic = deterministic
        self.bucket_bytes = bucket_bytes
        self.use_object_store = use_object_store
        self.last_publish_s = 0.0

    @property
    def version(self) -> int:
        return self.backend.version

    def get_version(self) -> int:
        return self.backend.version

    async def train(self, groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
        start = time.monotonic()
        if self.deterministic:
            # Groups arrive in completion order, which depends on timing; a fixed order
            # makes the gradient's summation order, hence the weights, reproducible.
            groups = sorted((sorted(g, key=lambda t: t.index_in_group) for g in groups),
                            key=lambda g: g[0].group_id)
        metrics = await asyncio.to_thread(self.backend.train_step, groups)
        metrics = dict(metrics)
        metrics["perf/train_step_s"] = time.monotonic() - start
        return metrics

    async def publish(self, broadcaster: Any) -> int:
        """Export, pack and hand the current weights to the broadcaster; returns the version."""
        start = time.monotonic()
        version = self.backend.version
        buckets = await asyncio.to_thread(self._pack_all, version)
        if self.use_object_store:
            import ray

            buckets = [ray.put(b) for b in buckets]
        await Peer(broadcaster).call("publish", version, buckets)
        self.last_publish_s = time.monotonic() - start
        return version

    def _pack_all(self, version: int) -> list[Any]:
        plans = list(self.backend.export_weights(self.bucket_bytes))
        return [pack(p, version=version, index=i, total=len(plans)) for i, p in enumerate(plans)]

    def export_hf(self, path: str, base_checkpoint: str) -> str:
        """Write the current policy as a Hugging Face checkpoint: the HF-named tensors the
        broadcaster ships, plus config and tokenizer files copied from ``base_checkpoint``
        (so ``--hf-checkpoint path`` and transformers both load it)."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().to("cpu").contiguous().clone()
                   for bucket in self.backend.export_weights(1 << 30) for name, t in bucket}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "miles_version": str(self.version)})
        for f in Path(base_checkpoint).iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
                shutil.copy2(f, out / f.name)
        return str(out)

    def ping(self) -> dict[str, float]:
        return {"train/version": float(self.backend.version), "perf/publish_s": self.last_publish_s,
                "mem/trainer_rss_mb": rss_mb()}

    def state_dict(self) -> dict[str, Any]:
        return self.backend.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.backend.load_state_dict(state)
