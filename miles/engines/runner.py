"""ModelRunner: the engine's device side — KV cache, prefill and decode forwards, CUDA graphs.

Everything here runs on the engine's stepping thread under ``torch.no_grad``. Inputs arrive
as host lists; outputs are device tensors that the sampler consumes. The step is split into
``prefill``, ``decode`` and ``verify`` calls (plus sampling in the engine); ``verify`` runs T
tokens per row against the cache in one forward (a speculative verify step, or a draft
model catching up on several tokens). A runner built with ``headroom`` > 0 has that many
spare cache positions past ``max_seq_len`` for draft tokens.

The CPU kernel (dense float32 models on the CPU, ``EngineConfig.cpu_decode_kernel``): a
decode step is one C call (``miles.kernels.cpu_decode``) instead of ~40 torch ops a layer;
it reads each row's KV only up to its own position, so no context bucket or split applies.

CUDA graphs (dense models on CUDA only): the decode forward for a batch padded up to a
bucket size ``nb`` and a context bucket ``L`` is captured once into a shared memory pool
(when first met, and with the length-aware kernel, whose context is always the whole cache,
every batch bucket's while the engine is idle: ``EngineConfig.capture_graphs_when_idle``), reading
tokens/positions from static buffers and writing logits and hidden states into static
outputs. Padding rows use free slots (``n..nb-1``) at position 0, so they never
touch a running request's cache. Weight updates copy into the parameters in place, so
captured graphs stay valid. Any capture failure disables graphs and decode continues
eagerly.

Short prefills are CUDA graphs too (``PrefillGraphs``): an eager prefill forward of a 28-layer
model costs many times its device time in host time whatever its size (the compiled layer
functions' wrappers and guards, ~56 calls), and several times more while another thread of
the process holds the GIL (a rollout worker's event loop; ``benchmarks/profile_admission.py``).
RL's short prompts arriving while hundreds of rows decode then make the prefill phase most of
the engine's busy time at low GPU use. A prefill of ``n`` rows of at most ``T`` tokens is padded to a batch bucket
``nb`` and a length bucket ``Tb`` (``PREFILL_T_BUCKETS``, ``nb × Tb ≤ PREFILL_GRAPH_TOKENS``)
and captured the second time that shape is met (one-off shapes stay eager). Padding rows write
their K/V into a scratch slot past ``max_batch_size`` that no request owns; padding tokens of a
real row write K/V past its context, which decode overwrites before it ever reads them (as the
eager prefill's right padding does). Prefills that need hidden states or routing (drafters,
MoE) and longer ones stay eager.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles.engines.config import EngineConfig
from miles.engines.kv_cache import DecodeAttention, KVCache, PrefillAttention, VerifyAttention
from miles.kernels import gate_up
from miles.models.model import CausalLM
from miles.utils.blas import blas_threads_for

log = logging.getLogger(__name__)

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def batch_buckets(cap: int) -> list[int]:
    """The padded batch sizes a graph cache captures: ``_BATCH_BUCKETS`` below ``cap``, then ``cap``."""
    return [b for b in _BATCH_BUCKETS if b < cap] + [cap]


PREFILL_T_BUCKETS = (8, 16, 32, 64, 128, 256)  # prompt lengths a prefill graph pads to
PREFILL_GRAPH_TOKENS = 8192  # padded tokens (rows × length bucket) of the largest prefill graph
PREFILL_GRAPH_AFTER = 2  # a prefill shape is captured when met this many times


@dataclass
class StepOut:
    logits: Tensor | None  # [n, V] float32, or the model dtype from decode(native_logits=True); last position of each row
    hidden: Tensor | None  # prefill: [n, T, H]; decode: [n, H]
    routing: Tensor | None  # prefill: [n, T, L_moe, k]; decode: [n, L_moe, k]


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, *, headroom: int = 0) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype()
        self.model = model
        self.is_moe = model.config.is_moe
        use_graphs = config.cuda_graphs and self.device.type == "cuda" and not self.is_moe
        prefill_graphs = use_graphs and not config.deterministic
        # with prefill graphs, one scratch slot past the requests' for their padding rows
        self.cache = KVCache(model.config, config.max_batch_size + int(prefill_graphs), config.max_seq_len,
                             self.device, self.dtype, headroom=headroom, kv_dtype=config.kv_torch_dtype())
        model.rotary.reserve(self.cache.length, self.device, self.dtype)  # with tables in the engine dtype
        self.verify_graphs: Any = None  # set by the speculative decoder on CUDA
        self.block = config.block()
        self.attention = config.attention_mode(model.config.head_dim)
        # the triton kernel reads each row only up to its own length, so decode passes the
        # whole cache length as the context: one CUDA graph per batch bucket, no padding read
        self.length_aware = self.attention == "triton"
        self.fused_mlp = self._fused_mlp()
        self.graphs = DecodeGraphs(self) if use_graphs else None
        self.prefill_graphs = PrefillGraphs(self) if prefill_graphs else None
        # The CPU's decode step in one C call (miles.kernels.cpu_decode): dense float32 models,
        # not in deterministic mode (its padded batch-invariant steps stay on torch ops).
        self.cpu_kernel = None
        if self.device.type == "cpu" and config.use_cpu_decode_kernel():
            from miles.kernels.cpu_decode import CpuDecoder

            self.cpu_kernel = CpuDecoder.build(model, self.cache, config.max_batch_size, self.dtype)
            if self.cpu_kernel is None and config.cpu_decode_kernel:
                raise ValueError("cpu_decode_kernel=True, but the CPU decode kernel cannot run here (see the log)")
        split = config.decode_split
        self.split = (self.graphs is None if split is None else split) and self.attention == "matmul"
        # Cache positions decode steps attended to (Σ contexts) and read (rows × bucket): a
        # step reads every row up to the longest context, so one long row in a batch of
        # short ones makes most of the KV read padding (engine/kv_read_useful_frac).
        self.kv_useful = self.kv_read = 0
        # The widest GEMM a row goes through (multiply-adds): small CPU steps run their GEMMs
        # on one BLAS thread (miles.utils.blas says why).
        cfg = model.config
        self.gemm_width = cfg.hidden_size * max((cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
                                                * cfg.head_dim, 2 * cfg.intermediate_size, cfg.vocab_size)

    def _fused_mlp(self) -> bool:
        """Whether decode steps run the gate/up GEMM and SiLU·up as one kernel
        (``EngineConfig.decode_fused_mlp``; dense layers with the residual adds in the GEMMs)."""
        if not (self.config.decode_fused_mlp and self.config.decode_residual_gemm and self.device.type == "cuda"):
            return False
        reason = gate_up.failure(str(self.device), self.dtype)
        if reason is not None:
            log.warning("decode_fused_mlp: the gate/up kernel %s; decode keeps the GEMM and SiLU·up apart", reason)
        return reason is None

    def _blas(self, rows: int) -> contextlib.AbstractContextManager[None]:
        """One BLAS thread for a CPU step of ``rows`` rows whose GEMMs are all small."""
        if self.device.type != "cpu":
            return contextlib.nullcontext()
        return blas_threads_for(rows * self.gemm_width)

    def _tensor(self, data: list, dtype: torch.dtype = torch.long) -> Tensor:
        t = torch.tensor(data, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def context_bucket(self, longest: int) -> int:
        """Rounded-up number of cache positions a decode step reads (≤ max_seq_len)."""
        if self.config.deterministic:
            return self.cache.length  # one reduction length for every step
        b = self.block
        return min(-(-longest // b) * b, self.cache.length)

    def read_length(self, longest: int) -> int:
        """The context a decode or verify step passes to attention: the padded bucket, or
        with the length-aware kernel (which reads each row only up to its own length) the
        whole cache, so that one CUDA graph shape serves every context length."""
        return self.cache.length if self.length_aware else self.context_bucket(longest)

    # ---- prefill -----------------------------------------------------------------------
    def prefill(self, slots: list[int], seqs: list[list[int]], *, logits: bool,
                hidden: bool = False, routing: bool = False) -> StepOut:
        """Write the K/V of ``seqs`` (each from position 0) into ``slots``; logits at each
        sequence's last token when ``logits``."""
        if self.prefill_graphs is not None and not hidden:  # (MoE models, which route, have no graphs)
            out = self.prefill_graphs.run(slots, seqs)
            if out is not None:
                return out
        return self.prefill_eager(slots, seqs, logits=logits, hidden=hidden, routing=routing)

    def prefill_eager(self, slots: list[int], seqs: list[list[int]], *, logits: bool,
                      hidden: bool = False, routing: bool = False) -> StepOut:
        n, T = len(seqs), max(len(s) for s in seqs)
        ids = self._tensor([s + [0] * (T - len(s)) for s in seqs])
        pos = torch.arange(T, device=self.device).expand(n, T)
        last = self._tensor([len(s) - 1 for s in seqs])
        with self._blas(n * T):
            out = self.model(
                ids, pos, kv_cache=PrefillAttention(self.cache, self._tensor(slots)),
                return_logits=logits, logits_index=last, return_hidden=hidden,
                return_routing=routing and self.is_moe, check_inputs=False,
            )
        return StepOut(None if out.logits is None else out.logits[:, 0], out.hidden, out.routing)

    def warm_compiled(self) -> bool:
        """Compile the layers' step functions for every shape class before serving them.

        The compiled functions are dynamic in batch and length, but dynamo specializes a size
        of 1: a prefill of one prompt, or of one token, is a variant of its own, compiled the
        first time it is met — in the middle of a run, with the stepping thread held (and the
        GIL, so the worker's event loop lags) for the whole compile while every other row
        waits. An asynchronous run at a tight staleness bound admits prompts a few at a time,
        so it met the one-row prefill inside its measured steps. Run here once per shape
        class: prefills of 1 and 2 rows of 1 and 2 tokens, and decode steps of 1 and 2 rows,
        in slots 0 and 1 at positions 0 to 2. Those cache entries are put back afterwards, so
        the warm-up may run while requests hold those slots (the switch from eager step
        functions, ``miles.engines.warmup``). Returns whether every shape ran; failures are
        logged and otherwise left to the serving path, which reports them where they matter."""
        rows = (1, 2) if self.config.max_batch_size >= 2 else (1,)
        span = (slice(None), slice(0, len(rows)), slice(None), slice(0, 3))
        saved = self.cache.k[span].clone(), self.cache.v[span].clone()
        try:
            for n in rows:
                for T in (1, 2):
                    self.prefill_eager(list(range(n)), [[0] * T] * n, logits=True)
                positions = self._tensor([2] * n)
                self.decode_eager(self._tensor([0] * n), positions, self.read_length(3))
        except Exception:
            log.warning("warming the compiled step functions failed; they compile when first met", exc_info=True)
            return False
        finally:
            self.cache.k[span].copy_(saved[0])
            self.cache.v[span].copy_(saved[1])
        return True

    # ---- decode ------------------------------------------------------------------------
    def decode(self, tokens: Tensor | list[int], positions: list[int], *, native_logits: bool = False) -> StepOut:
        """One token per running request (host list, or device tensor from the previous
        step's samples); request i occupies slot i (i < n). ``native_logits``: the caller
        takes logits in the model's dtype (a CUDA graph's, then, without a float32 copy)."""
        useful = sum(positions) + len(positions)
        self.kv_useful += useful
        if self.cpu_kernel is not None:  # reads each row up to its own position
            self.kv_read += useful
            logits, hidden = self.cpu_kernel.decode(tokens, positions)
            return StepOut(logits, hidden, None)
        L = self.read_length(max(positions) + 1)
        split = self.choose_split(positions, L) if self.split and not self.config.deterministic else None
        self.kv_read += useful if self.length_aware else len(positions) * L if split is None else split[2]
        if self.config.deterministic:
            return self._decode_padded(tokens, positions, L)
        if self.graphs is not None and split is None:
            out = self.graphs.run(tokens, positions, L, native_logits=native_logits)
            if out is not None:
                return out
        if not isinstance(tokens, Tensor):
            tokens = self._tensor(tokens)
        rows = None if split is None else (split[0], self._tensor(split[1]))
        return self.decode_eager(tokens, self._tensor(positions), L, split=rows)

    def choose_split(self, positions: list[int], L: int) -> tuple[int, list[int], int] | None:
        """(S, the rows reading past S, positions read) when reading ``[0, S)`` for every row and
        ``[S, L)`` for the long rows only reads under 70% of ``n × L`` (the long rows' range is
        counted three times: gathered, read, merged); None otherwise."""
        n = len(positions)
        ends = sorted(p + 1 for p in positions)
        best, best_cost = None, 0.7 * n * L
        i = 0
        for S in sorted({self.context_bucket(e) for e in ends}):
            if S >= L:
                break
            while i < n and ends[i] <= S:
                i += 1
            cost = n * S + 3 * (n - i) * (L - S)
            if cost < best_cost:
                best, best_cost = S, cost
        if best is None:
            return None
        long_rows = [r for r, p in enumerate(positions) if p + 1 > best]
        return best, long_rows, n * best + len(long_rows) * (L - best)

    def _decode_padded(self, tokens: Tensor | list[int], positions: list[int], L: int) -> StepOut:
        """Decode with every slot's row present, so matmul shapes never change: the extra
        rows write K/V at position 0 of free slots, which a later prefill overwrites."""
        n, rows = len(positions), self.config.max_batch_size
        if isinstance(tokens, Tensor):
            tokens = tokens.tolist()
        out = self.decode_eager(self._tensor(list(tokens) + [0] * (rows - n)),
                                self._tensor(list(positions) + [0] * (rows - n)), L)
        routing = None if out.routing is None else out.routing[:n]
        return StepOut(out.logits[:n], out.hidden[:n], routing)

    def decode_at(self, tokens: Tensor, positions: Tensor, L: int) -> StepOut:
        """``decode`` with device-side positions and a context bucket the caller knows."""
        if self.graphs is not None:
            out = self.graphs.run(tokens, positions, L)
            if out is not None:
                return out
        return self.decode_eager(tokens, positions, L)

    def decode_eager(self, tokens: Tensor, positions: Tensor, L: int, *,
                     split: tuple[int, Tensor] | None = None, logits: bool = True) -> StepOut:
        """One decode step run op by op (``logits=False``: the final hidden states only)."""
        # the fused gate/up kernel where it measured faster than the two launches (gate_up.MIN_ROWS)
        fused_mlp = self.fused_mlp and tokens.shape[0] >= gate_up.MIN_ROWS
        backend = DecodeAttention(self.cache, positions, L, self.attention, split=split,
                                  rope=self.config.decode_fuse_rope,
                                  residual_gemm=self.config.decode_residual_gemm, fused_mlp=fused_mlp,
                                  chunk=self.config.decode_attention_chunk)
        with self._blas(tokens.shape[0]):
            out = self.model(tokens[:, None], positions[:, None], kv_cache=backend, return_hidden=True,
                             return_routing=self.is_moe, return_logits=logits, check_inputs=False)
        routing = None if out.routing is None else out.routing[:, 0]
        return StepOut(None if out.logits is None else out.logits[:, 0], out.hidden[:, 0], routing)

    # ---- verify (several tokens per row) -------------------------------------------
    def verify(self, tokens: Tensor, starts: list[int] | Tensor, *, L: int | None = None,
               logits_index: Tensor | None = None, logits: bool = True) -> StepOut:
        """``tokens`` [n, T] at positions ``starts[i] .. starts[i] + T - 1`` of slot i (a host
        list, or a device tensor with the context bucket ``L``). Returns logits [n, T, V] (or
        [n, V] at ``logits_index``), hidden [n, T, H] and routing [n, T, L_moe, k] (MoE)."""
        T = tokens.shape[1]
        if L is None:
            L = self.read_length(max(starts) + T)
        graphs = self.verify_graphs
        if graphs is not None and logits and logits_index is None:
            out = graphs.run(tokens, starts, L)
            if out is not None:
                return out
        if not isinstance(starts, Tensor):
            starts = self._tensor(starts)
        return self.verify_eager(tokens, starts, L, logits_index=logits_index, logits=logits)

    def verify_eager(self, tokens: Tensor, starts: Tensor, L: int, *, logits_index: Tensor | None = None,
                     logits: bool = True) -> StepOut:
        T = tokens.shape[1]
        backend = VerifyAttention(self.cache, starts, T, L, self.attention, chunk=self.config.decode_attention_chunk)
        with self._blas(tokens.shape[0] * T):
            out = self.model(tokens, backend.positions, kv_cache=backend, return_hidden=True,
                             return_logits=logits, logits_index=logits_index,
                             return_routing=self.is_moe, check_inputs=False)
        lg = out.logits if out.logits is None or logits_index is None else out.logits[:, 0]
        return StepOut(lg, out.hidden, out.routing)


GRAPH_CAPTURES = {"count": 0, "seconds": 0.0}  # this process's captures (engine stats report them)


def compile_seconds() -> float:
    """Seconds this process has spent in ``torch.compile`` (dynamo and inductor: tracing a
    new shape variant, generating and loading its kernels), cumulative; 0 when nothing
    compiled. A step that meets a variant for the first time is held for the compile, in the
    stepping thread and holding the GIL most of the time, so its seconds are no measure of
    the step's phase: the stepper counts them apart (``engine/compile_s``). Nothing has compiled
    while dynamo is not imported, and this does not import it (seconds of the first step of an
    engine that serves eagerly first: ``miles.engines.warmup``)."""
    if "torch._dynamo" not in sys.modules:
        return 0.0
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without dynamo's timers
        return 0.0
    return sum(compilation_time_metrics.get("_compile.compile_inner", ()))


def capture_graph(step: Callable[[], None], pool: Any) -> Any:
    """A CUDA graph of ``step`` in the memory ``pool``, after two warm-up runs on a side
    stream (``step`` must be idempotent: it recomputes the same outputs). Captured with
    thread_local errors, so CUDA work on other threads (weight staging, the caller) may go on.
    Each (batch bucket, context bucket) shape is captured once, when first met: in a short
    run with changing batch sizes and long contexts the captures can take a sizable share of
    the time, which ``engine/graph_captures`` and ``engine/graph_capture_s`` show."""
    start, compiled = time.perf_counter(), compile_seconds()
    try:
        return _capture(step, pool)
    finally:
        GRAPH_CAPTURES["count"] += 1
        # a compile in the warm-up runs is the compile's (``compile_seconds``), not the capture's
        GRAPH_CAPTURES["seconds"] += time.perf_counter() - start - (compile_seconds() - compiled)


def _capture(step: Callable[[], None], pool: Any) -> Any:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        step()
    return graph


class GraphCache:
    """CUDA graphs by shape key in one memory pool, each captured when first needed. Graphs
    are an optimisation: a capture that fails switches the cache off for good, loudly, and
    its caller runs eagerly from then on (``graph`` returns None)."""

    fallback = "running eagerly"  # what the warning says happens instead
    buckets: list[int]  # the subclass's batch_buckets(max_batch_size)

    def __init__(self) -> None:
        self.graphs: dict[tuple, Any] = {}
        self.pool: Any = None
        self.failed = False

    def batch_bucket(self, n: int) -> int:
        """The smallest batch bucket that holds ``n`` rows."""
        return next(b for b in self.buckets if b >= n)

    def graph(self, key: tuple, step: Callable[[], None]) -> Any | None:
        """The graph of ``key``, captured from ``step`` if it is new; None once off."""
        graph = self.graphs.get(key)
        if graph is not None or self.failed:
            return graph
        try:
            graph = self.graphs[key] = self._capture(step)
        except Exception as exc:
            log.warning("%s capture failed (%s); %s from now on", type(self).__name__, exc, self.fallback)
            self.failed = True
            return None
        return graph

    def _capture(self, step: Callable[[], None]) -> Any:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return capture_graph(step, self.pool)


class DecodeGraphs(GraphCache):
    """Decode-step CUDA graphs keyed by (batch bucket, context bucket), captured lazily."""

    fallback = "decoding eagerly"

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__()
        self.runner = runner
        cap = runner.config.max_batch_size
        self.buckets = batch_buckets(cap)
        dev = runner.device
        self.tokens = torch.zeros(cap, dtype=torch.long, device=dev)
        self.positions = torch.zeros(cap, dtype=torch.long, device=dev)
        cfg = runner.model.config
        # The LM head writes its logits here in the model's dtype: no float32 copy a step
        # (a sampler that reads them directly asks for them so: ``run(native_logits=True)``).
        self.logits = torch.zeros(cap, cfg.vocab_size, dtype=runner.dtype, device=dev)
        self.hidden = torch.zeros(cap, cfg.hidden_size, dtype=runner.dtype, device=dev)

    def _step(self, nb: int, L: int) -> None:
        out = self.runner.decode_eager(self.tokens[:nb], self.positions[:nb], L, logits=False)
        torch.mm(out.hidden, self.runner.model.lm_head.weight.t(), out=self.logits[:nb])
        self.hidden[:nb].copy_(out.hidden)

    def run(self, tokens: Tensor | list[int], positions: list[int] | Tensor, L: int, *,
            native_logits: bool = False) -> StepOut | None:
        if self.failed:
            return None
        n = len(positions)
        nb = self.batch_bucket(n)
        pad = nb - n
        if isinstance(tokens, Tensor):
            self.tokens[:n].copy_(tokens)
            self.tokens[n:nb].zero_()
        else:
            self.tokens[:nb].copy_(self.runner._tensor(tokens + [0] * pad))
        if isinstance(positions, Tensor):
            self.positions[:n].copy_(positions)
            self.positions[n:nb].zero_()
        else:
            self.positions[:nb].copy_(self.runner._tensor(positions + [0] * pad))
        graph = self.graph((nb, L), lambda: self._step(nb, L))
        if graph is None:
            return None
        graph.replay()
        logits = self.logits[:n]
        return StepOut(logits if native_logits else logits.float(), self.hidden[:n], None)

    def missing(self) -> list[int]:
        """The batch buckets whose decode graph is not captured yet, smallest first; none
        where graphs are off or failed, or keyed by context too (only the length-aware kernel
        serves every step with one context, so only its buckets are known in advance)."""
        if self.failed or not self.runner.length_aware or self.runner.config.deterministic:
            return []
        L = self.runner.cache.length
        return [nb for nb in self.buckets if (nb, L) not in self.graphs]

    def capture_next(self) -> bool:
        """Capture the smallest missing bucket's graph (``EngineConfig.capture_graphs_when_idle``:
        the engine calls this while it has nothing to step, so a batch whose size wanders
        rarely stops for a capture, and the first request never waits for all of them).
        Returns whether one was captured."""
        missing = self.missing()
        if not missing:
            return False
        nb, L = missing[0], self.runner.cache.length
        # The capture runs the step for token 0 at position 0 of slots 0..nb-1: that position's
        # K/V is put back afterwards, so parked requests (partial rollouts) keep theirs.
        self.tokens[:nb].zero_()
        self.positions[:nb].zero_()
        cache = self.runner.cache
        saved = cache.k[:, :nb, :, 0].clone(), cache.v[:, :nb, :, 0].clone()
        try:
            return self.graph((nb, L), lambda: self._step(nb, L)) is not None
        finally:
            cache.k[:, :nb, :, 0].copy_(saved[0])
            cache.v[:, :nb, :, 0].copy_(saved[1])


class PrefillGraphs(GraphCache):
    """Prefill CUDA graphs keyed by (batch bucket, length bucket), each captured the
    ``PREFILL_GRAPH_AFTER``-th time its shape is met (see the module docstring for why).
    Every graph computes the logits at each row's last token; padding rows go to the
    scratch slot ``max_batch_size``."""

    fallback = "prefilling eagerly"

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__()
        self.runner = runner
        cap = runner.config.max_batch_size
        self.scratch = cap  # the cache's extra slot
        self.buckets = batch_buckets(cap)
        self.t_buckets = [t for t in PREFILL_T_BUCKETS if t <= runner.cache.length]
        self.seen: dict[tuple[int, int], int] = {}
        dev = runner.device
        t_max = self.t_buckets[-1] if self.t_buckets else 0
        self.ids = torch.zeros(cap, t_max, dtype=torch.long, device=dev)
        self.positions = torch.arange(t_max, device=dev).expand(cap, t_max)
        self.slots = torch.full((cap,), self.scratch, dtype=torch.long, device=dev)
        self.last = torch.zeros(cap, dtype=torch.long, device=dev)
        self.logits = torch.zeros(cap, runner.model.config.vocab_size, dtype=torch.float32, device=dev)

    def key(self, n: int, T: int) -> tuple[int, int] | None:
        """The graph shape a prefill of ``n`` rows of at most ``T`` tokens pads to, or None
        when it is too long for a graph."""
        tb = next((t for t in self.t_buckets if t >= T), None)
        if tb is None or n > self.buckets[-1]:
            return None
        nb = self.batch_bucket(n)
        return (nb, tb) if nb * tb <= PREFILL_GRAPH_TOKENS else None

    def _step(self, nb: int, tb: int) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        runner = self.runner
        # flash / memory-efficient attention capture cleanly; cuDNN's is left out
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = runner.model(self.ids[:nb, :tb], self.positions[:nb, :tb],
                               kv_cache=PrefillAttention(runner.cache, self.slots[:nb]),
                               return_logits=True, logits_index=self.last[:nb], check_inputs=False)
        self.logits[:nb].copy_(out.logits[:, 0])

    def run(self, slots: list[int], seqs: list[list[int]]) -> StepOut | None:
        if self.failed:
            return None
        n = len(seqs)
        key = self.key(n, max(len(s) for s in seqs))
        if key is None:
            return None
        if key not in self.graphs:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < PREFILL_GRAPH_AFTER:
                return None
        nb, tb = key
        pad = nb - n
        rows = [s + [0] * (tb - len(s)) for s in seqs] + [[0] * tb] * pad
        # one host-to-device copy for ids, slots and last positions together
        packed = self.runner._tensor([r + [slot, len(s) - 1] for r, slot, s in zip(rows, slots, seqs)]
                                     + [r + [self.scratch, 0] for r in rows[n:]])
        self.ids[:nb, :tb].copy_(packed[:, :tb])
        self.slots[:nb].copy_(packed[:, tb])
        self.last[:nb].copy_(packed[:, tb + 1])
        graph = self.graph(key, lambda: self._step(nb, tb))
        if graph is None:
            return None
        graph.replay()
        return StepOut(self.logits[:n], None, None)
