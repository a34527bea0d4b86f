"""The engine's end of ``benchmarks/weight_sync.py``: a process that receives weight updates.

``EngineSide`` holds either a bare staging area over parameter tensors of a model's shapes
(bandwidth runs: the weights land exactly as they would in an engine, borrowed where the
transport allows, then one commit copy) or a real ``EmbeddedEngine`` decoding a batch (the
stall run: how long a weight update pauses decoding). The benchmark drives it in a spawned
process (``serve``: one message in, one reply out) for the distributed and CUDA IPC
transports, or as a Ray actor for the object store; the methods are the same.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import torch

from miles.engines.weights import WeightStager
from miles.transports import make_receiver
from miles.transports.changed import fingerprints

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class EngineSide:
    def __init__(self, device: str, worker_id: str = "engine0") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.worker_id = worker_id
        self.receivers: dict[str, Any] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.stager: WeightStager | None = None
        self.engine: Any = None
        self.requests: list[asyncio.Task] = []

    def _receiver(self, kind: str) -> Any:
        if kind not in self.receivers:
            self.receivers[kind] = make_receiver(kind, worker_id=self.worker_id, device=self.device)
        return self.receivers[kind]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- bandwidth ------------------------------------------------------------------------
    async def setup(self, shapes: list[tuple[str, tuple[int, ...]]], dtype: str) -> int:
        self.params = {n: torch.zeros(s, dtype=DTYPES[dtype], device=self.device) for n, s in shapes}
        self.stager = WeightStager(self.params, self.device, DTYPES[dtype])
        return sum(p.numel() * p.element_size() for p in self.params.values())

    async def join(self, spec: Any, rank: int) -> bool:
        await asyncio.to_thread(self._receiver("distributed").join, spec, rank)
        return True

    async def receive(self, update: Any) -> dict[str, float]:
        """Stage ``update`` (borrowed), note when it is all there, then commit (timed)."""
        t_in = time.monotonic()
        n = await self._receiver(update.transport).receive(update, lambda named: self.stager.stage(named, borrow=True))
        t_received = time.monotonic()
        self._sync()
        t_staged = time.monotonic()
        start = time.perf_counter()
        self.stager.apply()
        self._sync()
        return {"t_in": t_in, "t_received": t_received, "t_staged": t_staged, "tensors": float(n),
                "swap_s": time.perf_counter() - start}

    async def fingerprint(self) -> dict[str, tuple[int, int]]:
        return fingerprints(list(self.params.items()))

    async def raw_get(self, refs: list[Any]) -> float:
        """Object-store ceiling: get a raw buffer (zero-copy), land it on the engine's device."""
        arr = await refs[0]
        if self.device.type == "cuda":
            torch.from_numpy(arr).to(self.device)
            self._sync()
        return time.monotonic()

    async def raw_broadcast(self, nbytes: int, iters: int) -> bool:
        """Distributed ceiling: receive ``iters`` raw broadcasts of ``nbytes`` on the group."""
        import torch.distributed as dist

        receiver = self._receiver("distributed")
        device = self.device if receiver.spec.backend == "nccl" else torch.device("cpu")
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def run() -> None:
            for _ in range(iters):
                dist.broadcast(buf, src=0, group=receiver.group)
            self._sync()

        await asyncio.to_thread(run)
        return True

    # ---- stall ----------------------------------------------------------------------------
    async def stall_begin(self, model: dict[str, Any], engine: dict[str, Any], requests: int,
                          max_new_tokens: int, warm_steps: int) -> list[tuple[str, tuple[int, ...]]]:
        """Build a random-weight engine, start ``requests`` long generations, return once it
        has decoded ``warm_steps`` steps; returns the names and shapes an update must have."""
        from miles.engines import EmbeddedEngine, EngineConfig
        from miles.models import CausalLM, ModelConfig
        from miles.types import GenerateRequest, SamplingParams

        cfg = ModelConfig(**model)
        with torch.device(self.device):
            lm = CausalLM(cfg)
        with torch.no_grad():
            lm.reset_parameters(torch.Generator(device=self.device).manual_seed(0))
        self.engine = EmbeddedEngine(lm, config=EngineConfig(device=str(self.device), **engine))
        g = torch.Generator().manual_seed(1)
        for i in range(requests):
            ids = torch.randint(10, cfg.vocab_size, (16,), generator=g).tolist()
            req = GenerateRequest(rid=f"r{i}", input_ids=ids,
                                  sampling=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, seed=i))
            self.requests.append(asyncio.ensure_future(self.engine.generate(req)))
        while self.engine.stats_.counters["decode_steps"] < warm_steps:
            await asyncio.sleep(0.01)
        sd = self.engine.model.state_dict()
        tied = cfg.tie_word_embeddings
        return [(n, tuple(t.shape)) for n, t in sd.items() if not (tied and n == "lm_head.weight")]

    async def stall_update(self, update: Any, after_steps: int) -> dict[str, float]:
        """Receive ``update`` while decoding, commit it, decode ``after_steps`` more steps;
        the pause the commit caused and the decode rate while the buckets arrived."""
        engine = self.engine
        t_in = time.monotonic()
        await self._receiver(update.transport).receive(
            update, lambda named: engine.stage_weights(named, borrow=True))
        t_staged = time.monotonic()
        await engine.commit_weights(update.version)
        t_committed = time.monotonic()
        steps = engine.stats_.counters["decode_steps"]
        while engine.stats_.counters["decode_steps"] < steps + after_steps:
            await asyncio.sleep(0.01)
        rate = list(engine.stats_.rate)
        await engine.abort(None)
        await asyncio.gather(*self.requests, return_exceptions=True)
        await engine.close()
        versions_ok = engine.version == update.version
        self.engine, self.requests = None, []
        return {**decode_gaps(rate, t_in, t_staged, t_committed), "swap_pause_s": engine.swap_pauses[-1],
                "t_in": t_in, "t_staged": t_staged, "t_committed": t_committed, "version_ok": float(versions_ok)}


def decode_gaps(rate: list[tuple[float, int]], t_in: float, t_staged: float, t_committed: float) -> dict[str, float]:
    """From the engine's (time, tokens so far) per step: the typical step before the update,
    the longest gap between two steps around the commit, and tokens/s while staging vs
    before."""
    before = [(b[0] - a[0]) for a, b in zip(rate, rate[1:]) if b[0] < t_in]
    around = [(b[0] - a[0]) for a, b in zip(rate, rate[1:]) if b[0] >= t_staged and a[0] <= t_committed + 0.05]
    step = statistics.median(before) if before else 0.0

    def tokens_per_s(lo: float, hi: float) -> float:
        inside = [(t, n) for t, n in rate if lo <= t <= hi]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return 0.0
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    head = rate[0][0] if rate else t_in
    return {"step_s": step, "gap_s": max(around, default=0.0), "stall_s": max(max(around, default=0.0) - step, 0.0),
            "tps_before": tokens_per_s(head, t_in), "tps_staging": tokens_per_s(t_in, t_staged)}


def serve(device: str, inbox: Any, outbox: Any) -> None:
    """A spawned engine process: call the named method for each message, reply with the
    result (or the error's text)."""
    side = EngineSide(device)

    async def loop() -> None:
        while True:
            msg = await asyncio.to_thread(inbox.get)
            if msg is None:
                return
            method, args = msg
            try:
                outbox.put(("ok", await getattr(side, method)(*args)))
            except Exception as exc:  # the benchmark prints it
                outbox.put(("error", f"{type(exc).__name__}: {exc}"))

    asyncio.run(loop())
    for receiver in side.receivers.values():
        close = getattr(receiver, "close", None)
        if callable(close):
            close()
