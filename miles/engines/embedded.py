"""EmbeddedEngine: the pure-PyTorch rollout engine (a ``miles.protocols.RolloutEngine``).

Wiring: a RolloutWorker builds one engine around a CausalLM and awaits
``engine.generate(request)`` for many requests at once; the WeightBroadcaster's deliveries
arrive as ``update_weights`` (or ``stage_weights`` + ``commit_weights``); partial rollouts
use ``abort``.

Threading: all model work runs on one dedicated *stepping thread*; the asyncio side only
enqueues requests and control messages and awaits futures that the thread resolves with
``loop.call_soon_threadsafe``. So ``await engine.generate(...)`` never blocks the worker's
event loop — rewards, environment steps and other coroutines interleave with decoding
(torch kernels release the GIL; the thread's Python overhead is shared at the interpreter's
switch interval). The thread loops: apply control (aborts, weight commits, pause) → admit
waiting requests and prefill them (batched, right-padded, grouped by length; on CUDA a
trickle of arrivals is admitted in batches, ``EngineConfig.admit_min``) → one decode step for every
running request (continuous batching: requests join and leave between steps) → sample →
hand finished requests back (``stepper.py``; on CUDA the next step is launched before the
previous one is read back). Model and cache state are touched by that thread only; its
loop lives in ``stepping.py``.

Weight updates: ``stage_weights`` puts tensors into a staging area (``weights.py``; copied on
a side stream, or borrowed when they already sit on the engine's device in its dtype) while
the stepping thread keeps decoding — staging never takes a lock a decode step needs.
``commit_weights`` is applied between two decode steps, all at once, and the version flips
after every staged tensor is in; that copy is the only pause decoding sees, and it is
measured (``engine/swap_pause_s``, ``_max``, ``_mean``). Tokens sampled after the swap record
the new version. With ``keep_kv_cache=False`` every in-flight request re-prefills its
context with the new weights first (AReaL); with ``True`` it keeps the cache computed by
the old ones (PipelineRL).

Hidden states (``return_hidden_states``) come back through ``pop_hidden_states(rid)``:
``[len(context) - 1, H]`` float32, row p = final-norm hidden state at context position p
(the feature that predicted token p + 1) — what an EAGLE draft head trains on.

Speculative decoding (``draft=`` a CausalLM or an EagleHead, ``speculative=`` a
SpeculativeConfig; ``spec/``): steps become rounds in which the draft proposes k tokens
per row and the policy verifies them in one forward; the recorded log-probs and versions
stay the policy's. Draft weights have their own staged updates and version
(``update_draft_weights``), applied between steps like the policy's and never touching
the policy version.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import torch

from miles.engines.config import EngineConfig
from miles.engines.offload import EngineOffloader, WeightsMode
from miles.engines.oom import EngineOOM
from miles.engines.requests import Request
from miles.engines.runner import GRAPH_CAPTURES, ModelRunner
from miles.engines.sampling import compile_counter_uniform, fused_draw_classes
from miles.engines.spec.config import MAX_STEPS, SpeculativeConfig
from miles.engines.stepper import EngineStats, Stepper
from miles.engines.stepping import SteppingLoop, step_mode
from miles.engines.warmup import CompileSwitch
from miles.engines.weights import WeightStager
from miles.models import quant
from miles.models.quant_io import WireDecoder
from miles.models.checkpoint import load_pretrained
from miles.models.fused import compile_fast_path
from miles.models.model import CausalLM
from miles.models.tokenizer import load_tokenizer
from miles.protocols import NamedTensors
from miles.types import GenerateOutput, GenerateRequest

log = logging.getLogger(__name__)
__all__ = ["EmbeddedEngine", "step_mode"]  # step_mode lives in ``stepping``; warmup imports it from here


class EmbeddedEngine(SteppingLoop):
    def __init__(self, model: CausalLM, *, config: EngineConfig | None = None,
                 tokenizer: Any = None, version: int = 0, draft: Any = None,
                 speculative: SpeculativeConfig | None = None, draft_version: int = 0,
                 shared: frozenset[str] = frozenset(), colocated_trainer: tuple[int, int] | None = None) -> None:
        """Takes ownership of ``model`` (and ``draft``): moves it to ``config.device`` /
        dtype, freezes grads. Speculation needs both ``draft`` and an enabled ``speculative``.
        ``shared``: parameters that are a colocated trainer's frozen base (``over_shared_base``).
        ``colocated_trainer``: the (resident state, micro-batch activation) bytes of a trainer on
        the same GPU; on CUDA the memory plan then reserves its peak, ``--engine-mem-fraction`` or not."""
        self.config = config = config or EngineConfig()
        if shared and (draft is not None or quant.spec_of(model) is not None or model.config.is_moe):
            raise ValueError("an engine over a shared base runs dense, unquantized, non-speculative models only")
        config.validate(model.config.max_position_embeddings, model.config.head_dim)
        self.device, self.dtype = torch.device(config.device), config.torch_dtype()
        # where construction's seconds go (``engine/init_<part>_s``; the worker's start-up)
        self.init_parts: dict[str, float] = {}
        mark = time.perf_counter()

        def lap(part: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            self.init_parts[part] = self.init_parts.get(part, 0.0) + now - mark
            mark = now

        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        lap("to_device")
        self.quant = quant.spec_of(self.model)  # set by apply_quantization before the engine is built
        self.tokenizer = tokenizer
        spec_on = draft is not None and speculative is not None and speculative.enabled
        # the compiled step functions from a background child (``warmup``): a plain, unquantized
        # policy whose fast path is the compiled layer functions alone
        background = config.warm_in_background() and self.quant is None and not spec_on
        self.compile_inline = config.use_compile() and not background  # warmed before serving
        if self.quant is None:  # quantized layers run their own GEMMs: the fused fast path would bypass them
            self.model.fuse_projections(compile_fast_path() if self.compile_inline else None)
        if self.compile_inline:
            compile_counter_uniform(self.device)  # seeded draws: one fused kernel on CUDA
        lap("fuse_compile")
        self.memory_plan = None
        if (config.engine_mem_fraction is not None or colocated_trainer is not None) and self.device.type == "cuda":
            from miles.engines.memory import measure_plan

            self.memory_plan = measure_plan(self.model, config, config.kv_torch_dtype() or self.dtype,
                                            trainer=colocated_trainer)
            log.warning("%s", self.memory_plan.describe())
            config = self.config = msgspec.structs.replace(config, max_batch_size=self.memory_plan.slots)
        lap("memory_plan")
        self.runner = ModelRunner(self.model, config, headroom=MAX_STEPS + 2 if spec_on else 0)
        lap("runner")  # the KV cache, graph buffers, the kernels' probe launches (their first compile)
        self.spec = self._build_spec(draft, speculative, draft_version) if spec_on else None
        self.shared = shared
        self.stager = WeightStager(self.model, self.device, self.dtype, shared=shared)
        if shared:  # its decode kernel reads the weights alone: the adapters live beside them
            self.runner.cpu_kernel = None
        # --offload-rollout (``offload``): the trainer's shared tensors are never released
        own = {n: t for n, t in self.stager.params.items() if n not in shared}
        self.offloader = EngineOffloader(self.runner, own)
        self.wire = WireDecoder(self.dtype)  # quantized weight updates -> the parameters' dtype
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.stats_ = EngineStats()
        self.swap_pauses: deque[float] = deque(maxlen=256)  # seconds each commit paused decoding
        self._hidden: dict[str, torch.Tensor] = {}
        self.stepper = Stepper(
            self.runner, config, eos_ids=self.eos_ids, tokenizer=tokenizer,
            generator=torch.Generator(device=self.device).manual_seed(config.seed),
            stats=self.stats_, on_done=self._done, spec=self.spec,
        )
        self.stepper.version = version
        lap("stepper")  # the fused sampler's probe draw
        self.oom = EngineOOM(config.max_batch_size, config.max_prefill_tokens, config.inject_oom_steps)
        self._cv = threading.Condition()  # guards queues and control flags
        self._stage_lock = threading.Lock()  # staging vs applying weights, not decoding
        self._waiting: deque[Request] = deque()
        self._deferred_steps = 0  # steps that left waiting requests waiting (see _admit_now)
        self._abort_rids: set[str] = set()
        self._abort_all = False
        self._commits: deque[tuple[int, bool, asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._draft_commits: deque[tuple[int, asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._pause_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._pause_requested = self._paused = self._closed = False
        self._thread: threading.Thread | None = None
        self._last_work = 0.0  # when the stepping thread last stepped or took a control (``_capture_due``)
        self.compile_stats: dict[str, float] = {}  # the switch's figures (``warmup``), once it happened
        self._compile = CompileSwitch(self) if background else None  # its child starts now
        lap("rest")

    def _build_spec(self, draft: Any, cfg: SpeculativeConfig, draft_version: int) -> Any:
        from miles.engines.spec.decoder import SpecDecoder
        from miles.engines.spec.drafters import make_drafter
        from miles.engines.spec.graphs import RoundGraphs, VerifyGraphs
        from miles.models.draft import check_compatible

        check_compatible(draft, self.model.config)
        drafter = make_drafter(draft, self.model, self.config, version=draft_version)
        spec = SpecDecoder(self.runner, drafter, cfg)
        if self.runner.graphs is not None:  # dense model on CUDA with graphs on
            self.runner.verify_graphs = VerifyGraphs(self.runner, cfg.speculative_num_steps + 1)
            spec.round_graphs = RoundGraphs(spec, cfg.speculative_num_steps, all_k=cfg.speculative_adaptive)
        return spec

    @classmethod
    def over_shared_base(cls, model_config: Any, base: dict[str, torch.Tensor], *,
                         config: EngineConfig | None = None, **kwargs: Any) -> EmbeddedEngine:
        """An engine serving a colocated LoRA trainer's frozen base (``miles.engines.shared``):
        no second copy of it; adapters applied unmerged. Raises where sharing cannot work
        (``shared.sharing_problem``): the caller then builds an engine of its own."""
        from miles.engines import shared as sharing

        config = config or EngineConfig()
        problem = sharing.sharing_problem(model_config, base, config.device, config.torch_dtype())
        if problem:
            raise ValueError(f"the engine cannot serve the trainer's base weights shared: {problem}")
        model, names = sharing.engine_model(model_config, base, config.device, config.torch_dtype())
        return cls(model, config=config, shared=names, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, config: EngineConfig | None = None,
                        version: int = 0) -> EmbeddedEngine:
        """An engine over a local HF checkpoint directory (+ its tokenizer.json if any)."""
        config = config or EngineConfig()
        model = load_pretrained(path, dtype=config.torch_dtype(), device=config.device)
        tokenizer = load_tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None
        return cls(model, config=config, tokenizer=tokenizer, version=version)

    # ---- public API ------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.stepper.version

    def start(self) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="miles-engine", daemon=True)
                self._thread.start()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        error = self._validate(request) or self.oom.fatal
        if error is not None:
            return GenerateOutput(rid=request.rid, finish_reason="error", error=error)
        if request.sampling.max_new_tokens - request.num_prefix_tokens <= 0:
            return GenerateOutput(rid=request.rid, finish_reason="length")
        if self._closed:
            raise RuntimeError("engine is closed")
        loop = asyncio.get_running_loop()
        req = Request(request, loop, loop.create_future())
        with self._cv:
            if any(r.rid == request.rid for r in (*self._waiting, *self.stepper.running)):
                return GenerateOutput(rid=request.rid, finish_reason="error",
                                      error=f"request id {request.rid!r} is already in flight")
            self._waiting.append(req)
        loop.call_soon(self._wake)
        try:
            return await req.future
        except asyncio.CancelledError:
            await self.abort(request.rid)
            raise

    def _wake(self) -> None:
        """Start or wake the stepping thread. ``generate`` queues its request and calls this at
        the end of the event loop's pass, so the requests that one pass submits (a worker's
        leased batch) are all waiting when an idle engine takes its next step: they start in
        one prefill whatever the machine's load."""
        with self._cv:  # a reentrant lock: start() takes it too
            if not self._closed:
                self.start()
                self._cv.notify()

    async def abort(self, rid: str | None = None) -> None:
        with self._cv:
            keep: deque[Request] = deque()
            for r in self._waiting:
                if rid is None or r.rid == rid:
                    r.aborted = True
                    self.stats_.counters["requests_aborted"] += 1
                    r.resolve()
                else:
                    keep.append(r)
            self._waiting = keep
            if rid is None:
                self._abort_all = True
            else:
                self._abort_rids.add(rid)
            self._cv.notify()

    async def pause(self) -> None:
        """Stop stepping at the next step boundary (requests stay in the batch)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            if self._thread is None or self._paused:
                self._paused = self._pause_requested = True
                return
            self._pause_requested = True
            self._pause_waiters.append((loop, fut))
            self._cv.notify()
        await fut

    async def resume(self) -> None:
        with self._cv:
            self._pause_requested = self._paused = False
            self._cv.notify()

    async def offload(self, weights: WeightsMode = "discard") -> int:
        """Release the KV cache (and the weights: ``offload.py`` says how) until the next
        weight commit, which re-allocates them; returns the bytes released. Work in flight is
        aborted first (it comes back as partial rollouts) and the engine stays paused until
        that commit. A quantized engine releases its KV cache alone (its derived buffers
        stay); a speculative one refuses (its verify graphs and drafter read the cache)."""
        if self.spec is not None:
            raise ValueError("offload is not supported with speculative decoding yet")
        if self.quant is not None:
            weights = "keep"
        await self.abort()
        await self.pause()
        return await asyncio.to_thread(self._release, weights)

    def _release(self, weights: WeightsMode) -> int:
        with self._stage_lock:  # no commit re-allocates while this releases
            return self.offloader.release(weights)

    def stage_weights(self, named_tensors: NamedTensors, *, borrow: bool = False) -> int:
        """Validate and stage tensors (HF names) while decoding continues; returns how many.
        ``borrow``: keep tensors that already have the engine's device and dtype by
        reference (the caller leaves them untouched until the commit) instead of copying."""
        with self._stage_lock:  # never held by a decode step: decoding goes on meanwhile
            named_tensors = self.wire.decode(named_tensors)
            return self.stager.stage(named_tensors, borrow=borrow)

    def discard_staged(self) -> None:
        """Drop whatever is staged (an update that failed half-way never gets committed)."""
        with self._stage_lock:
            self.stager.clear()
            self.wire.clear()

    async def commit_weights(self, version: int, *, keep_kv_cache: bool | None = None) -> None:
        """Swap the staged tensors in between two decode steps; ``version`` flips after all."""
        keep = self.config.keep_kv_cache_on_update if keep_kv_cache is None else keep_kv_cache
        if version < self.version:
            raise ValueError(f"weight version {version} is older than the engine's {self.version}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            idle = self._thread is None
            if not idle:
                self._commits.append((version, keep, loop, fut))
                self._cv.notify()
        if idle:  # nothing decoding: apply right here
            self._commit(version, keep)
            return
        await fut

    async def update_weights(self, named_tensors: NamedTensors, version: int, *,
                             keep_kv_cache: bool | None = None) -> None:
        """Full state dict or one bucket list of (HF name, tensor); staged, then committed."""
        await asyncio.to_thread(self.stage_weights, named_tensors)
        await self.commit_weights(version, keep_kv_cache=keep_kv_cache)

    # ---- the draft (speculative decoding) ----------------------------------------------
    @property
    def draft_version(self) -> int:
        """Version of the draft's weights (-1 without a draft); independent of ``version``."""
        return self.spec.drafter.version if self.spec is not None else -1

    def stage_draft_weights(self, named_tensors: NamedTensors) -> int:
        """Validate and stage draft tensors (their own names) while decoding continues."""
        if self.spec is None:
            raise RuntimeError("this engine has no draft model (speculative decoding is off)")
        with self._stage_lock:
            return self.spec.drafter.stager.stage(named_tensors)

    async def commit_draft_weights(self, version: int) -> None:
        """Swap the staged draft tensors in between two steps; the policy version is untouched."""
        if self.spec is None:
            raise RuntimeError("this engine has no draft model (speculative decoding is off)")
        if version < self.draft_version:
            raise ValueError(f"draft version {version} is older than the engine's {self.draft_version}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            idle = self._thread is None
            if not idle:
                self._draft_commits.append((version, loop, fut))
                self._cv.notify()
        if idle:
            self._commit_draft(version)
            return
        await fut

    async def update_draft_weights(self, named_tensors: NamedTensors, version: int) -> None:
        await asyncio.to_thread(self.stage_draft_weights, named_tensors)
        await self.commit_draft_weights(version)

    def spec_stats(self) -> dict[int, dict[str, float]]:
        """Per policy version: acceptance rate, mean accepted length, rounds (speculation)."""
        if self.spec is None:
            return {}
        return {v: s.as_dict() for v, s in sorted(self.spec.controller.by_version.items())}

    def pop_hidden_states(self, rid: str) -> torch.Tensor | None:
        hidden = self._hidden.pop(rid, None)
        return None if hidden is None else hidden.clone()  # a normal tensor: autograd may save it

    def progress(self, rid: str) -> int | None:
        """Tokens generated so far by an in-flight request (None if not in flight)."""
        with self._cv:
            for r in (*self.stepper.running, *self._waiting):
                if r.rid == rid:
                    return len(r.output_ids)
        return None

    def snapshot(self, rid: str) -> tuple[list[int], list[float], list[int]] | None:
        """(output_ids, logprobs, versions) an in-flight request has so far (None if not in
        flight); for streaming. Copies taken while the stepping thread may be appending, so
        cut to the shortest of the three."""
        with self._cv:
            for r in (*self.stepper.running, *self._waiting):
                if r.rid == rid:
                    ids, lps, vs = list(r.output_ids), list(r.logprobs), list(r.versions)
                    n = min(len(ids), len(lps), len(vs))
                    return ids[:n], lps[:n], vs[:n]
        return None

    def stats(self) -> dict[str, float]:
        st = self.stats_
        out = {f"engine/{k}": float(v) for k, v in st.counters.items()}
        with self._cv:  # the stepping thread moves an idle stretch into idle_s under this lock
            out.update({f"engine/{k}": v for k, v in st.seconds().items()})
            out.update({f"engine/{k}_s": v for k, v in st.phase_s.items()})
            out["engine/device_wait_s"] = st.device_wait_s
            out["engine/warm_compile_s"] = st.warm_s
            out.update({f"engine/init_{part}_s": v for part, v in self.init_parts.items()})
            switch = self._compile
        # whether the compiled step functions serve (``warmup``: 0 while the eager ones do), and the switch's figures
        out.update(self.compile_stats or (switch.stats if switch is not None
                                          else {"engine/compiled": float(self.compile_inline)}))
        occ = list(st.occupancy)
        out.update({
            "rollout/tokens_generated": float(st.counters["tokens_generated"]),
            "rollout/tokens_per_s": st.tokens_per_s(),
            "engine/batch_occupancy": sum(occ) / len(occ) if occ else 0.0,
            "engine/num_running": float(len(self.stepper.running)),
            "engine/num_waiting": float(len(self._waiting)),
            "engine/version": float(self.version),
            "engine/kv_cache_bytes": float(self.runner.cache.nbytes),
            "engine/kv_read_useful_frac": self.runner.kv_useful / self.runner.kv_read if self.runner.kv_read else 1.0,
            # 1: the engine serves a colocated LoRA trainer's base (one copy) with adapters unmerged;
            # 0: its own weights, adapters merged in (miles.engines.shared says when)
            "engine/lora_shared_base": float(bool(self.shared)),
            "engine/graph_captures": float(GRAPH_CAPTURES["count"]),
            "engine/graph_capture_s": GRAPH_CAPTURES["seconds"],
            # shape classes of the seeded draw running as one fused kernel (CUDA: 4 of 4 expected)
            "engine/fused_draw_classes": float(fused_draw_classes()) if self.device.type == "cuda" else 0.0,
            # 1 where decode steps run through the CPU kernel (0: torch ops; the log says why)
            "engine/cpu_decode_kernel": float(self.runner.cpu_kernel is not None),
            # 1 where untruncated steps draw their tokens through the fused Triton sampler
            "engine/fused_sampling": float(self.stepper.fused_sampling),
            # OOMs turned into parked rows and a smaller batch; the rows the engine now runs at once
            "mem/engine_oom_recovered": float(self.oom.recovered),
            "engine/batch_limit": float(self.oom.batch_limit),
            "engine/oom_fatal": float(self.oom.fatal is not None),
            # --offload-rollout: seconds releasing and re-allocating, bytes released last time
            "mem/offload_rollout_s": self.offloader.seconds,
            "mem/offload_rollout_bytes": float(self.offloader.released_bytes),
            "engine/offloaded": float(self.offloader.released),
        })
        pauses = list(self.swap_pauses)
        if pauses:
            out.update({"engine/swap_pause_s": pauses[-1], "engine/swap_pause_s_max": max(pauses),
                        "engine/swap_pause_s_mean": sum(pauses) / len(pauses)})
        if self.spec is not None:
            out.update(self.spec.controller.stats(self.version))
            out["spec/graph_rounds"] = float(self.spec.graph_rounds)
            out["spec/backlog_flushes"] = float(self.spec.backlog_flushes)
            out["spec/eager_probes"] = float(self.spec.eager_probes)
            out["spec/draft_version"] = float(self.draft_version)
        return out

    async def close(self) -> None:
        await self.abort()
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)
        switch, self._compile = self._compile, None
        if switch is not None:
            switch.stop()

    # ---- validation ------------------------------------------------------------------
    def _validate(self, request: GenerateRequest) -> str | None:
        ids, sp, V = request.input_ids, request.sampling, self.model.config.vocab_size
        if not ids:
            return "input_ids is empty"
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            return f"token id {bad} outside the vocabulary [0, {V})"
        if len(ids) >= self.config.max_seq_len:
            return (f"prompt of {len(ids)} tokens does not fit the context "
                    f"(max_seq_len={self.config.max_seq_len}, one new token at least)")
        if sp.temperature < 0 or not 0 < sp.top_p <= 1 or sp.top_k == 0 or sp.top_k < -1:
            return (f"invalid sampling params: temperature={sp.temperature} (>= 0), "
                    f"top_p={sp.top_p} (in (0, 1]), top_k={sp.top_k} (-1 or >= 1)")
        if sp.stop and self.tokenizer is None:
            return "stop strings need an engine built with a tokenizer"
        if request.num_prefix_tokens < 0:
            return f"num_prefix_tokens must be >= 0, got {request.num_prefix_tokens}"
        return None
