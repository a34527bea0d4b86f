"""The CPU decode step in one C call (``cpu_decode.c``), built with the machine's C compiler.

Why: a tiny policy decoding on a CPU spends its step in torch's per-op dispatch (~170 aten
calls for 4 layers, each costing more than its arithmetic at batch 1), which no torch-level
fusion fixes (``torch.compile`` on the CPU is slower: guard checks and wrapper calls cost more
than its kernels save).
``CpuDecoder.decode`` runs the whole forward of one decode step in one call: the GEMMs in the
BLAS torch links (its ``sgemm_``, so threads and maths are torch's), the rest as plain loops
that read each row's KV only up to its own position. ``CpuDecoder.sample`` then draws the
step's tokens, their log-probs and the finite check in a second call (the same tokens as
``miles.engines.sampling.sample`` from the same uniforms; top-k / top-p stay on torch ops).
On the tiny CPU model a decode step is several times faster than through torch ops
(``benchmarks/engine.py``).

The library is compiled once per source, compiler and CPU (``-O3 -march=native``) into
``$MILES_KERNEL_CACHE`` (default ``~/.cache/miles/kernels``; a per-user temp folder where that
is not writable), a second or two. Each load marks its file used; each build removes the
builds there that went unused for ``STALE_DAYS`` (an edited source, compiler or CPU makes a new
key, so old files would otherwise pile up). Where there is
no compiler, torch links no ``sgemm_`` (non-MKL builds), or the model is not a dense float32
decoder, ``CpuDecoder.build`` returns None and says why; the engine then decodes with torch
ops, as before. The engine's ``cpu_decode_kernel`` turns it off; ``--deterministic`` keeps the
torch path (its batch-invariant padded steps).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles.kernels.constants import GOLDEN, GREEDY_EPS, MIX1, MIX2, UNIFORM_BITS, UNIFORM_SHIFT
from miles.utils import blas

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared", "-pthread"]
_ERRORS = {1: "a token id outside the vocabulary", 2: "a position outside the KV cache"}


class KernelUnavailable(RuntimeError):
    """The C decode step cannot be used here (the message says why)."""


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
        return "\n".join(wanted) or platform.processor()
    except OSError:
        return platform.machine() + platform.processor()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise KernelUnavailable("no C compiler (cc, gcc or clang) on PATH")
    return cc


def _cache_dirs() -> list[Path]:
    """``$MILES_KERNEL_CACHE``, else ``~/.cache/miles/kernels``; then a per-user temp folder."""
    first = os.environ.get("MILES_KERNEL_CACHE") or Path.home() / ".cache" / "miles" / "kernels"
    return [Path(first), Path(tempfile.gettempdir()) / f"miles-kernels-{os.getuid()}"]


STALE_DAYS = 30  # a cached build unused this long is removed by the next build beside it


def _prune(folder: Path, keep: Path) -> None:
    """Remove the builds in ``folder`` unused for ``STALE_DAYS`` (never ``keep``). A process
    still running one keeps its mapping; one about to load it falls back to torch ops."""
    cutoff = time.time() - STALE_DAYS * 86400
    for old in folder.glob("cpu_decode-*.so"):
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # another process removed it first, or the folder is shared read-only
            pass


def _compile(cc: str, flags: tuple[str, ...], path: Path) -> None:
    """Build the library at ``path``: into a temporary file beside it, renamed when complete
    (processes building at once each write their own file; the rename is atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        try:
            done = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                                  timeout=300)
        except subprocess.SubprocessError as exc:
            raise KernelUnavailable(f"{cc} did not build {SOURCE.name}: {exc}") from None
        if done.returncode != 0:
            raise KernelUnavailable(f"{cc} failed to build {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL:
    """The compiled kernel (built on first use, then cached on disk); raises KernelUnavailable."""
    return build(tuple(FLAGS))


@functools.cache
def build(flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernel compiled with ``flags`` (tests also build it without the AVX-512 paths)."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"{cc} --version failed: {exc}") from None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(flags), version, _cpu_signature()]).encode())
    name = f"cpu_decode-{key.hexdigest()[:16]}.so"
    cached = [root / name for root in _cache_dirs()]
    path = next((p for p in cached if p.is_file()), None)
    if path is None:
        problems = []
        for target in cached:  # the first directory that takes the file
            try:
                _compile(cc, flags, target)
                path = target
                break
            except OSError as exc:  # unwritable, full, or noexec: try the next one
                problems.append(f"{target.parent}: {exc}")
        if path is None:
            raise KernelUnavailable("no writable directory for the compiled kernel (" + "; ".join(problems) + ")")
        _prune(path.parent, path)
    else:
        try:
            os.utime(path)  # used now: not stale for the next build's prune
        except OSError:  # a read-only cache still serves
            pass
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load {path}: {exc}") from None
    lib.miles_decode.restype = ctypes.c_int
    lib.miles_decode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.miles_sample.restype = None
    lib.miles_sample.argtypes = [ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 5
    lib.miles_hashed_uniform.restype = None
    lib.miles_hashed_uniform.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint64,
                                         ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64, ctypes.c_float,
                                         ctypes.c_void_p]
    lib.miles_decode_workspace.restype = ctypes.c_int64
    lib.miles_decode_workspace.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    return lib


def torch_sgemm() -> int:
    """Address of the Fortran ``sgemm_`` in the BLAS that torch's CPU library links."""
    address = blas.symbol("sgemm_")
    if not address:
        raise KernelUnavailable("this torch build exports no sgemm_ (its CPU BLAS is not MKL)")
    return address


def unsupported(model: Any, dtype: torch.dtype) -> str | None:
    """Why ``model`` cannot decode through the kernel, or None."""
    cfg = model.config
    if dtype != torch.float32:
        return f"the kernel is float32 only (engine dtype {dtype})"
    if cfg.is_moe:
        return "the kernel has no MoE layers"
    if cfg.hidden_act != "silu":
        return f"the kernel has no {cfg.hidden_act!r} activation"
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        return "query heads are not a multiple of KV heads"
    if any(getattr(layer, "fast_args", None) is None for layer in model.model.layers):
        return "the model's projections are not fused (CausalLM.fuse_projections)"
    return None


class CpuDecoder:
    """Decode steps of one fused dense ``CausalLM`` over one ``KVCache`` through the kernel.

    Holds the addresses of the model's weights: the engine updates weights in place
    (``WeightStager``), which keeps them valid, as it does for the fused layers' own views."""

    def __init__(self, model: Any, cache: Any, max_batch: int, lib: ctypes.CDLL | None = None) -> None:
        cfg = model.config
        self.lib, self.sgemm = lib or library(), torch_sgemm()
        # small GEMMs on one BLAS thread (miles.utils.blas; None where the BLAS is not MKL)
        self.set_threads, self.one_thread_gemm = blas.set_threads_address() or None, blas.ONE_THREAD_GEMM
        self.model, self.cache = model, cache
        self.eps = float(cfg.rms_norm_eps)
        self.hidden_size, self.vocab = cfg.hidden_size, cfg.vocab_size
        self._tensors: list[Tensor] = []  # what the pointer table points into (kept alive)
        self._cos: Tensor | None = None
        self._table()
        self.threads = max(1, torch.get_num_threads())  # attending threads the workspace has room for
        words = self.lib.miles_decode_workspace(ctypes.addressof(self._dims), max_batch, self.threads)
        self.ws = torch.empty(words, dtype=torch.float32)

    @classmethod
    def build(cls, model: Any, cache: Any, max_batch: int, dtype: torch.dtype) -> CpuDecoder | None:
        """A decoder, or None (logged) where the kernel does not apply or cannot be built."""
        why = unsupported(model, dtype)
        if why is None:
            try:
                return cls(model, cache, max_batch)
            except KernelUnavailable as exc:
                why = str(exc)
        log.info("CPU decode kernel off (%s): decoding with torch ops", why)
        return None

    def _table(self) -> None:
        """The dims and pointer arrays the kernel reads (rebuilt if the rope table grows)."""
        m, cfg, cache = self.model, self.model.config, self.cache
        rotary = m.rotary
        self._cos = rotary._cos
        layers: list[Tensor | None] = []
        for layer in m.model.layers:
            (first, _sizes, _o), second = layer.fast_args
            norm_w, _eps, qkv_w, qkv_b, qn, kn = first
            o_w, o_b, post_w, _post_eps, gate_up_w, down_w = second
            layers += [norm_w, qkv_w, qkv_b, qn, kn, o_w, o_b, post_w, gate_up_w, down_w]
        model_wide = [m.model.embed_tokens.weight, m.model.norm.weight, m.lm_head.weight, cache.k, cache.v,
                      rotary._cos, rotary._sin]
        tensors = [t.detach() if t is not None else None for t in model_wide + layers]
        for t in tensors:
            if t is not None and not (t.is_contiguous() and t.dtype == torch.float32 and t.device.type == "cpu"):
                raise KernelUnavailable("a weight is not a contiguous float32 CPU tensor")
        self._tensors = [t for t in tensors if t is not None]
        self._ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() if t is not None else None for t in tensors])
        L, slots, kv, length, d = cache.k.shape
        dims = [L, cfg.hidden_size, cfg.num_attention_heads, kv, d, cfg.intermediate_size, cfg.vocab_size,
                slots, length, rotary._cos.shape[0]]
        self._dims = (ctypes.c_int64 * len(dims))(*dims)

    def decode(self, tokens: Tensor | list[int], positions: list[int]) -> tuple[Tensor, Tensor]:
        """Logits [n, V] (float32) and final hidden states [n, E] of one step; row i is slot i."""
        if self.model.rotary._cos is not self._cos:
            self._table()
        n = len(positions)
        tok = tokens.to(torch.int64).contiguous() if isinstance(tokens, Tensor) else torch.tensor(tokens)
        pos = torch.tensor(positions, dtype=torch.int64)
        hidden = torch.empty(n, self.hidden_size)
        logits = torch.empty(n, self.vocab)
        rc = self.lib.miles_decode(ctypes.addressof(self._dims), ctypes.addressof(self._ptrs), self.eps,
                                   self.sgemm, self.set_threads, self.one_thread_gemm, n, tok.data_ptr(),
                                   pos.data_ptr(), hidden.data_ptr(), logits.data_ptr(), self.ws.data_ptr(),
                                   min(self.threads, torch.get_num_threads()))
        if rc:
            raise ValueError(f"decode step refused: {_ERRORS.get(rc, f'error {rc}')}")
        return logits, hidden

    def hashed_uniform(self, keys: list[int], V: int) -> Tensor:
        """``sampling.counter_uniform`` of these row keys, bitwise, in one C pass."""
        out = torch.empty(len(keys), V, dtype=torch.float32)
        k = torch.tensor(keys, dtype=torch.int64)
        self.lib.miles_hashed_uniform(len(keys), V, k.data_ptr(), GOLDEN, MIX1, MIX2, UNIFORM_SHIFT,
                                      1.0 / (1 << UNIFORM_BITS), out.data_ptr())
        return out

    def sample(self, logits: Tensor, batch: Any, generator: torch.Generator | None
               ) -> tuple[Tensor, Tensor] | None:
        """``sampling.sample`` plus the finite check in one call (``batch``: the engine's
        ``SamplingBatch``): (tokens [n] int64, host
        [3, n] float64 rows token / log-prob / finite), the same tokens as ``sample`` draws
        from the same generator state. None where a row truncates (top-k / top-p): the
        caller samples with torch ops then."""
        if batch.truncates():
            return None
        n, V = logits.shape
        temps = [0.0 if t <= GREEDY_EPS else t for t in batch.temperature]
        drawn = [i for i, t in enumerate(temps) if t > 0.0]
        noise = None
        if drawn:
            keys = [batch.keys[i] for i in drawn]
            u = (self.hashed_uniform(keys, V) if all(k is not None for k in keys)
                 else batch.uniforms(drawn, V, logits.device, generator))
            noise = torch.log(-torch.log(u))
        temperature = torch.tensor(temps, dtype=torch.float32)
        tokens = torch.empty(n, dtype=torch.int64)
        host = torch.empty(3, n, dtype=torch.float64)
        logits = logits.contiguous()
        self.lib.miles_sample(n, V, logits.data_ptr(), temperature.data_ptr(),
                              None if noise is None else noise.data_ptr(), tokens.data_ptr(), host.data_ptr())
        return tokens, host
