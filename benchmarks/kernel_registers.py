"""Registers, spills and shared memory of the Triton kernels' variants, compiled offline.

Why: a kernel form can be slower where its new code never runs, because it raised the
registers a thread needs past an occupancy step (an inlined in-kernel merge of the decode
attention did that: benchmarks/log/history.md, decode_attention, 2026-12-01 21:14: 4-8% slower a
layer with no row merging; 144 registers a thread against 106, so 3 programs an SM instead of 4). This
compiles each variant with the installed triton and its bundled ptxas for a GPU architecture
(default sm_90, the H200), with no GPU: it runs on any machine with triton.

Each kernel gets the arguments the engine's call passes: the launch function runs on CPU
tensors of the engine's shapes (the Qwen3-0.6B decode step, batch 64 over a 2049-position
cache), with the kernel swapped for a recorder; the recorded arguments are specialised as
triton specialises them at a launch (integers equal to 1 become constants, multiples of 16
and pointers get the divisibility hint, except the kernel's ``do_not_specialize``).
Programs an SM: the lowest of the register, shared-memory and warp limits of the
architecture (``ARCH``). Loop instructions a position: a warp's SASS instructions in the
attention's inner loop over its BLOCK_N positions, the cost of an issue-bound form (the 8-bit
cache's, by Nsight Compute on the H200); for the fused sampler's ``_chunk``, a thread's loop
instructions an entry of the vocabulary. These are static counts (both sides of a branch in
the loop count, such as the sampler's temperature-1 and greedy paths):
``benchmarks/decode_attention.py`` and ``benchmarks/sampling.py`` time.

    python benchmarks/kernel_registers.py [--arch 90] [--no-record]

Appends a section to benchmarks/log/kernel_registers.md (``--no-record`` to skip).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import machine  # noqa: E402
from benchmarks.trainer import record_section  # noqa: E402

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # noqa: E402
    triton = None

# registers an SM, registers a warp is given at a time, shared memory an SM (bytes, less the
# 1 KB a program reserves), warps an SM, programs an SM
ARCH = {80: (65536, 256, 163 * 1024, 64, 32), 90: (65536, 256, 227 * 1024, 64, 32)}
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
           torch.int32: "*i32", torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}
KV, G, D, ROWS, CACHE = 8, 2, 128, 64, 2049  # Qwen3-0.6B's attention; batch 64 over a 2049-position cache
VOCAB = 151936  # Qwen3's


class Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kw)`` records the call."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def signature(fn, args: tuple, kw: dict) -> tuple[dict, dict, dict, dict]:
    """triton's specialisation of one launch: (signature, constexprs, attrs, options)."""
    options = {k: kw[k] for k in ("num_warps", "num_stages") if k in kw}
    constexprs = {k: v for k, v in kw.items() if k not in options}
    sig, attrs = {}, {}
    for i, (name, value) in enumerate(zip(fn.arg_names, args)):
        free = name in fn.do_not_specialize
        if isinstance(value, torch.Tensor):
            sig[name] = POINTER[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are 16-byte aligned
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not free:
                sig[name], constexprs[name] = "constexpr", 1
                continue
            sig[name] = "i32" if -(2 ** 31) <= value < 2 ** 31 else "i64" if value < 2 ** 63 else "u64"
            if value % 16 == 0 and not free:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}.{name}: {type(value).__name__}")
    for name in constexprs:
        sig[name] = "constexpr"
    return sig, constexprs, attrs, options


def loop_instructions(sass: str, marker: str = "MMA") -> int | None:
    """SASS instructions in the body of the innermost loop that holds a ``marker`` instruction
    (the tensor-core dots; a backward branch's span), or None: per loop trip, the figure an
    issue-bound kernel's time follows."""
    body = loop_body(sass, marker)
    return len(body) if body is not None else None


def loop_mix(body: list[str] | None) -> collections.Counter:
    """A ``loop_body``'s instructions by opcode (predicates dropped): where an issue-bound loop's
    instructions go."""
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body or [])


def loop_body(sass: str, marker: str = "MMA") -> list[str] | None:
    """The instructions of the innermost loop that holds a ``marker`` instruction, or None."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
    index = {address: i for i, (address, _) in enumerate(lines)}
    labels = {m.group(1): int(m.group(2), 16)
              for m in re.finditer(r"^\.(L_x_\d+):\s*\n\s+/\*([0-9a-f]+)\*/", sass, re.M)}
    bodies = []
    for i, (address, text) in enumerate(lines):
        m = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", text)
        if m and labels.get(m.group(1), address) < address:
            body = [t for _, t in lines[index[labels[m.group(1)]] : i + 1]]
            if any(marker in t for t in body):
                bodies.append(body)
    return min(bodies, key=len) if bodies else None


def usage(fn, args: tuple, kw: dict, arch: int) -> dict:
    sig, constexprs, attrs, options = signature(fn, args, kw)
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([str(tools / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    field = dict(item.split(":", 1) for item in line.split() if ":" in item)
    regs, stack, shared = int(field["REG"]), int(field["STACK"]), compiled.metadata.shared
    warps = options.get("num_warps", 4)
    reg_file, unit, smem, max_warps, max_programs = ARCH[arch]
    per_warp = -(-regs * 32 // unit) * unit
    fits = min(reg_file // (per_warp * warps), smem // max(shared, 1), max_warps // warps, max_programs)
    body = loop_body(sass)
    return dict(regs=regs, spill=stack, shared=shared, programs=fits, loop=len(body) if body else None,
                exp_loop=loop_instructions(sass, "MUFU"), mix=loop_mix(body))


def decode_attention_cases() -> list[tuple[str, object, tuple, dict]]:
    """The decode step's ``_partial`` (and ``_merge``) as the engine launches them."""
    from miles.engines.kv_cache import positions_last
    from miles.kernels import decode_attention as kernel

    cases = []
    fp8 = torch.float8_e4m3fn
    # (group, cache dtype, grid, V transposed, float16 dots): an 8-bit cache as KVCache stores it
    # (V transposed) with the kernel's default dots, then its former forms
    for g_size, kv_dtype, form, v_t, f16 in [(2, torch.bfloat16, "wide", False, False),
                                             (2, torch.bfloat16, "narrow", False, False),
                                             (2, fp8, "wide", True, kernel.F16_DOTS), (2, fp8, "wide", False, True),
                                             (2, fp8, "wide", True, False), (2, fp8, "wide", False, False),
                                             (1, torch.bfloat16, "wide", False, False),
                                             (8, torch.bfloat16, "wide", False, False)]:
        rows = ROWS if form == "wide" else 8
        qkv = torch.zeros(rows, KV * g_size + 2 * KV, D, dtype=torch.bfloat16)
        q, k, v = qkv.split((KV * g_size, KV, KV), dim=1)
        kc = torch.zeros(rows, KV, CACHE, D, dtype=kv_dtype)
        vc = positions_last(tuple(kc.shape), kc.device, kv_dtype) if v_t else kc.clone()
        rope = kernel.Rope(torch.zeros(rows, D, dtype=torch.bfloat16), torch.zeros(rows, D, dtype=torch.bfloat16),
                           torch.ones(D, dtype=torch.bfloat16), torch.ones(D, dtype=torch.bfloat16), 1e-6)
        lengths = torch.full((rows,), CACHE)
        launch = kernel.default_launch(rows * KV, kv_dtype)
        partial, merge = Recorder(kernel._partial), Recorder(kernel._merge)
        real = kernel._partial, kernel._merge
        kernel._partial, kernel._merge = partial, merge
        try:
            kernel._launch(q.view(rows, KV, g_size, D), kc, vc, lengths, D ** -0.5, CACHE, 1, 0,
                           torch.empty(rows, KV, g_size, D, dtype=torch.bfloat16), (k, v), launch, rope,
                           True, f16)
        finally:
            kernel._partial, kernel._merge = real
        layout = "" if kv_dtype != fp8 else (" (V transposed" if v_t else " (V position-major") + (
            ", float16 dots)" if f16 else ", bfloat16 dots)")
        name = (f"_partial, group {g_size}, {str(kv_dtype).removeprefix('torch.')} cache{layout}, {rows} rows, "
                f"launch {launch}")
        cases.append((name, real[0], *partial.calls[0]))
        if merge.calls and g_size == 2 and kv_dtype == torch.bfloat16 and form == "wide":
            cases.append((f"_merge, group {g_size}", real[1], *merge.calls[0]))
    return cases


def sampler_cases() -> list[tuple[str, object, tuple, dict]]:
    """The fused sampler's ``_chunk`` as a decode step launches it (152k vocabulary, bf16 logits,
    libdevice's logs as on a GPU): the default launch at batch 64 and 256, the per-block form,
    and the per-lane form at the former launch (2048, 8192, 4), which spilled on the H200."""
    from miles.kernels import sampling

    cases = []
    for rows, block, chunk, warps, lanes in [(64, None, None, None, True), (256, None, None, None, True),
                                             (64, None, None, None, False), (64, 2048, 8192, 4, True)]:
        recorder, real = Recorder(sampling._chunk), (sampling._chunk, sampling._finish)
        sampling._chunk, sampling._finish = recorder, Recorder(sampling._finish)
        try:
            sampling.sample(torch.zeros(rows, VOCAB, dtype=torch.bfloat16), torch.ones(rows),
                            torch.zeros(rows, dtype=torch.int64), block=block, chunk=chunk, warps=warps, lanes=lanes)
        finally:
            sampling._chunk, sampling._finish = real
        args, kw = recorder.calls[0]
        kw = {**kw, "PRECISE": True}  # libdevice's logs, as on a GPU (the CPU call would take tl.log)
        launch = (kw["BLOCK"], kw["CHUNK"], kw.get("num_warps", 4))
        form = "per-lane" if lanes else "per-block"
        name = f"_chunk (sampler), {rows} rows, launch (BLOCK, CHUNK, warps) {launch}, {form}"
        cases.append((name, real[0], args, kw))
    return cases


def gate_up_cases() -> list[tuple[str, object, tuple, dict]]:
    """The decode MLP's gate/up + SiLU·up kernel (``miles.kernels.gate_up``) at each of its
    default launches, on a Qwen3-0.6B MLP (hidden 1024, intermediate 3072)."""
    from miles.kernels import gate_up

    cases = []
    for rows in sorted({top for top, _ in gate_up.LAUNCHES if top < 1 << 32} | {256}):
        recorder, real = Recorder(gate_up._gate_up_silu), gate_up._gate_up_silu
        gate_up._gate_up_silu = recorder
        try:
            gate_up.gate_up_silu(torch.zeros(rows, 1024, dtype=torch.bfloat16),
                                 torch.zeros(6144, 1024, dtype=torch.bfloat16))
        finally:
            gate_up._gate_up_silu = real
        args, kw = recorder.calls[0]
        launch = (kw["BM"], kw["BN"], kw["BK"], kw.get("num_warps", 4), kw.get("num_stages", 3))
        cases.append((f"_gate_up_silu, {rows} rows, launch (BM, BN, BK, warps, stages) {launch}", real, args, kw))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, choices=sorted(ARCH))
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "kernel_registers.md"))
    args = ap.parse_args()
    if triton is None:
        sys.exit("kernel_registers needs triton (pip install triton): it compiles the kernels offline")
    lines = ["| kernel variant | registers a thread | spilled bytes | shared memory B | programs an SM | "
             "loop instructions a position |", "|---|---|---|---|---|---|"]
    mixes = ["", "| _partial variant | its loop's instructions (a warp, one trip) | positions a trip | "
             "the largest opcode classes |", "|---|---|---|---|"]
    for name, fn, call_args, call_kw in decode_attention_cases() + sampler_cases() + gate_up_cases():
        u = usage(fn, call_args, call_kw, args.arch)
        if "BLOCK_N" in call_kw:  # the attention: a warp's loop instructions over its BLOCK_N positions
            per = f"{u['loop'] / call_kw['BLOCK_N']:.1f}" if u["loop"] else ""
        elif "BLOCK" in call_kw:  # the sampler: a thread's loop instructions over its BLOCK / threads entries
            threads = 32 * call_kw.get("num_warps", 4)
            per = f"{u['exp_loop'] * threads / call_kw['BLOCK']:.1f} an entry" if u["exp_loop"] else "(unrolled)"
        elif "BK" in call_kw:  # the gate/up GEMM: a warp's loop instructions a K tile
            per = f"{u['loop']} a K tile of {call_kw['BK']}" if u["loop"] else ""
        else:
            per = ""
        lines.append(f"| {name} | {u['regs']} | {u['spill']} | {u['shared']} | {u['programs']} | {per} |")
        print(lines[-1])
        if "BLOCK_N" in call_kw and u["loop"]:
            top = ", ".join(f"{op} {n}" for op, n in u["mix"].most_common(8))
            mixes.append(f"| {name} | {u['loop']} | {call_kw['BLOCK_N']} | {top} |")
    desc = (f"registers, spills (local stack) and shared memory of the Triton decode attention's, sampler's and "
            f"gate/up GEMM's variants, compiled offline for sm_{args.arch} by triton {triton.__version__} and its "
            "ptxas (no GPU), "
            f"with the arguments of the engine's decode step (Qwen3-0.6B attention: {KV} KV heads, head dim {D}, "
            f"a {CACHE}-position cache; group 8 and 1 for other models' GQA); programs an SM by the register, "
            "shared-memory and warp limits; loop instructions a position: a warp's SASS in the inner loop / BLOCK_N "
            f"(the sampler: a thread's loop SASS / its entries, {VOCAB}-entry vocabulary)")
    record_section("kernel_registers", machine(), desc, lines + mixes, args.results, save=not args.no_record)


if __name__ == "__main__":
    main()
