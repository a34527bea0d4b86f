"""Low precision (miles.models.quant) in one process: weight bytes, decode speed, mismatch, MoE fit.

Parts (each under its own time limit, ``--part-timeout``):

- ``bytes``: weight bytes of a Qwen3-8B shape under FP8 (128 × 128 scales) and INT4 (all
  decoder linears, group 128) against bf16, for the quantized linears and the whole model
  (embedding and LM head stay bf16).
- ``decode``: one decode step's GEMMs of a Qwen3-8B shape (36 layers of fused qkv, o,
  fused gate/up, down, then the LM head) at each batch, bf16 ``F.linear`` against FP8
  (``torch._scaled_mm`` block-wise, activations quantized 1 × 128 in the step) and INT4
  (the Triton dequantizing GEMM), each step replayed as a CUDA graph. Attention is left
  out: it reads the KV cache, which is the same in every mode. tok/s = batch / step time.
- ``kl``: the mismatch KL(engine ‖ trainer) per token of unified FP8 against bf16 training
  with FP8 rollouts, on random decoders of the countdown example's shape (hidden 96) and of
  hidden 1024, the engine and the trainer paired as a run pairs them, with the default
  kernels and under ``--true-on-policy`` (``benchmarks/low_precision_kl.py`` says how).
- ``moe``: a Qwen3-30B-A3B shape (48 layers, 128 experts of 768, top-8, hidden 2048) with
  INT4 experts (random packed weights, group 128), decoding greedy tokens with a KV cache;
  the memory it holds, beside what its bf16 form would need.

``--tiny``: the same code on small shapes (the CPU check; on the CPU the FP8 and INT4 GEMMs
are the quantize–dequantize arithmetic).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from miles.kernels import lowp  # noqa: E402
from miles.models.quant import QuantSpec, quantize_weight  # noqa: E402

QWEN3_8B = dict(hidden=4096, inter=12288, layers=36, heads=32, kv=8, head_dim=128, vocab=151936)
TINY_8B = dict(hidden=256, inter=512, layers=2, heads=4, kv=2, head_dim=64, vocab=1024)
QWEN3_30B = dict(hidden=2048, moe_inter=768, layers=48, heads=32, kv=4, head_dim=128, vocab=151936,
                 experts=128, top_k=8)
TINY_30B = dict(hidden=256, moe_inter=128, layers=2, heads=4, kv=2, head_dim=64, vocab=1024, experts=8, top_k=2)
FP8, INT4 = QuantSpec("fp8"), QuantSpec("int4", 128, "all-linear")


class PartTimeout(Exception):
    pass


def _alarm(signum, frame):  # noqa: ANN001, ANN202
    raise PartTimeout()


def shapes_8b(s: dict) -> list[tuple[int, int]]:
    """(out, in) of one layer's fused GEMMs: qkv, o, gate/up, down."""
    h, d = s["hidden"], s["head_dim"]
    return [((s["heads"] + 2 * s["kv"]) * d, h), (h, s["heads"] * d), (2 * s["inter"], h), (h, s["inter"])]


def stored_bytes(shape: tuple[int, int], spec: QuantSpec | None) -> int:
    N, K = shape
    if spec is None:
        return N * K * 2
    if spec.kind == "fp8":
        return N * K + (-(-N // 128)) * (-(-K // 128)) * 4
    return N * K // 2 + N * (K // spec.group_size) * 4


def part_bytes(s: dict, out: dict) -> list[str]:
    layer = {name: sum(stored_bytes(sh, spec) for sh in shapes_8b(s)) * s["layers"]
             for name, spec in (("bf16", None), ("fp8", FP8), ("int4", INT4))}
    # check the formula against the quantizer's own tensors for one GEMM
    w = torch.randn(shapes_8b(s)[1], device=DEVICE, dtype=torch.bfloat16)
    for name, spec in (("fp8", FP8), ("int4", INT4)):
        q, scale = quantize_weight(w, spec)
        assert q.numel() * q.element_size() + scale.numel() * 4 == stored_bytes(tuple(w.shape), spec)
    rest = 2 * s["vocab"] * s["hidden"] * 2 + s["layers"] * 2 * s["hidden"] * 2  # embed, head, norms: bf16
    lines = ["| form | linear weights GB | × bf16 | whole model GB | × bf16 |", "|---|---|---|---|---|"]
    for name, b in layer.items():
        lines.append(f"| {name} | {b / 1e9:.2f} | {b / layer['bf16']:.3f} | {(b + rest) / 1e9:.2f} | "
                     f"{(b + rest) / (layer['bf16'] + rest):.3f} |")
        out[f"bytes_{name}_linear"], out[f"bytes_{name}_model"] = b, b + rest
    return lines


def _time(fn, iters: int) -> float:  # noqa: ANN001
    """Median seconds of ``fn`` (a CUDA graph replay where capture works)."""
    if DEVICE == "cuda":
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        except Exception:  # noqa: BLE001 - eager then
            run = fn
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def part_decode(s: dict, batches: list[int], out: dict, iters: int) -> list[str]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    head = torch.randn(s["vocab"], s["hidden"], device=DEVICE, dtype=DTYPE, generator=g) * 0.02
    results: dict[str, dict[int, float]] = {}
    for name, spec in (("bf16", None), ("fp8", FP8), ("int4", INT4)):
        layers = []
        for _ in range(s["layers"]):
            mats = []
            for N, K in shapes_8b(s):
                w = torch.randn(N, K, device=DEVICE, dtype=DTYPE, generator=g) * 0.02
                mats.append((w,) if spec is None else quantize_weight(w, spec))
                del w
            layers.append(mats)
        results[name] = {}
        for B in batches:
            x = torch.randn(B, s["hidden"], device=DEVICE, dtype=DTYPE, generator=g)

            def step(x=x, layers=layers, spec=spec):  # noqa: ANN001, ANN202
                h = x
                for qkv, o, gu, down in layers:
                    a = _lin(h, qkv, spec)
                    h = h + _lin(a[:, : s["heads"] * s["head_dim"]], o, spec)
                    gate, up = _lin(h, gu, spec).chunk(2, dim=-1)
                    h = h + _lin(F.silu(gate) * up, down, spec)
                return F.linear(h, head)

            results[name][B] = _time(step, iters)
        del layers
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    lines = ["| batch | bf16 tok/s | fp8 tok/s | × bf16 | int4 tok/s | × bf16 |", "|---|---|---|---|---|---|"]
    for B in batches:
        tb, tf, ti = results["bf16"][B], results["fp8"][B], results["int4"][B]
        lines.append(f"| {B} | {B / tb:.0f} | {B / tf:.0f} | {tb / tf:.2f} | {B / ti:.0f} | {tb / ti:.2f} |")
        out[f"decode_{B}"] = {"bf16_s": tb, "fp8_s": tf, "int4_s": ti}
    lines.append(f"FP8 GEMM path per shape and batch: {json.dumps(lowp.FP8_PATH)}; INT4 path per shape and batch: "
                 f"{json.dumps(lowp.INT4_PATH)}")
    if lowp.FP8_ERRORS:
        lines.append(f"_scaled_mm forms refused: {json.dumps(lowp.FP8_ERRORS)}")
    lines.append(_check_gemms(s))
    return lines


def _check_gemms(s: dict) -> str:
    """The low-precision GEMMs against the quantizer's dequantized arithmetic (one shape)."""
    from miles.models.quant import dequantize_weight, fp8_qdq_act

    N, K = shapes_8b(s)[2]
    w = torch.randn(N, K, device=DEVICE, dtype=DTYPE) * 0.02
    x = torch.randn(16, K, device=DEVICE, dtype=DTYPE)
    errs = []
    for spec in (FP8, INT4):
        stored = quantize_weight(w, spec)
        xin = fp8_qdq_act(x) if spec.kind == "fp8" else x
        ref = F.linear(xin.float(), dequantize_weight(stored[0], stored[1], spec, torch.float32))
        got = _lin(x, stored, spec).float()
        errs.append(f"{spec.kind} {float((got - ref).norm() / ref.norm()):.2e}")
    return f"GEMM check at {N}x{K}, batch 16 (relative error against the dequantized float32 product): {', '.join(errs)}"


def _lin(x: torch.Tensor, stored: tuple, spec: QuantSpec | None) -> torch.Tensor:
    if spec is None:
        return F.linear(x, stored[0])
    return lowp.linear(x, stored, spec) if DEVICE == "cuda" else _cpu_lin(x, stored, spec)


def _cpu_lin(x: torch.Tensor, stored: tuple, spec: QuantSpec) -> torch.Tensor:
    from miles.models.quant import dequantize_weight, fp8_qdq_act

    xin = fp8_qdq_act(x) if spec.kind == "fp8" else x
    return F.linear(xin, dequantize_weight(stored[0], stored[1], spec, x.dtype))


def _tiled(BN, programs, warps=4, stages=3):  # noqa: ANN001, ANN202, N803
    return dict(path="tiled", BN=BN, programs=programs, warps=warps, stages=stages)


def _gv(BN, U, warps, programs=1056, split=0, **flags):  # noqa: ANN001, ANN003, ANN202, N803
    return dict(path="gemv", BN=BN, U=U, split=split, programs=programs, warps=warps, stages=2, **flags)


def _dt(BN, U, warps, programs=1056, JOIN=True, NIB16=0, stages=2, **flags):  # noqa: ANN001, ANN003, ANN202, N803
    return dict(path="dott", BN=BN, BM=16, U=U, split=0, programs=programs, warps=warps, stages=stages, JOIN=JOIN,
                NIB16=NIB16, **flags)


_NEW = dict(PF=True, INPLACE=True, RED=True)  # gemv: prefetch, nibbles in place, split-K summed in the kernel
_B2 = dict(NIB16=2, RED=True)  # dott: biased bf16 operands (no subtraction a nibble), split-K summed in the kernel
# launches tried per batch: the word-wise kernels (lowp_triton.w4a16_gemv: BN, U groups a step, warps, split-K
# (0: up to `programs` programs), PF, INPLACE, RED, XP; w4a16_dott: the same with JOIN, NIB16) and the tiled
# GEMM. The 2026-12-07 15:49 sweep (benchmarks/log/low_precision.md) tried ~50 launches a shape: prefetch,
# in-place nibbles, in-kernel split-K sums, biased operands and swapped dot operands each measured within ±5%
# of the earlier kernels or slower (SWAP, 256-row or 2-warp tiles 1.5-2.5× slower): its winners per shape
# stay here beside the plane-major activations (XP), which that sweep had not tried.
INT4_CANDIDATES = {
    1: [_gv(16, 8, 4), _gv(16, 8, 4, programs=528, **_NEW), _gv(16, 4, 2, programs=2112, **_NEW),
        *(_gv(BN, U, w, programs=p, XP=True, **flags) for BN, U, w, p, flags in (
            (16, 8, 4, 1056, {}), (16, 4, 2, 2112, {}), (8, 8, 4, 1056, {}), (16, 8, 4, 528, {}), (32, 4, 4, 1056, {}),
            (16, 16, 4, 1056, {}), (8, 4, 2, 2112, {}), (16, 8, 4, 1056, dict(INPLACE=True)),
            (16, 8, 4, 2112, dict(RED=True)), (16, 4, 2, 2112, _NEW), (16, 8, 4, 1056, dict(PF=True)),
            (8, 8, 2, 2112, {}), (32, 8, 4, 1056, {})))],
    16: [_dt(64, 2, 4, NIB16=1), _dt(64, 2, 4, programs=528), _dt(64, 1, 4, programs=528, PF=True, **_B2),
         _tiled(64, 264)],
}
FP8_CANDIDATES = {  # (path, BM, BN, warps, stages[, split-K]); cublas: the Triton activation kernel + _scaled_mm
    1: [("cublas",), ("triton", 16, 64, 4, 4), ("triton", 16, 32, 4, 4, 3)],
    16: [("cublas",), ("triton", 16, 64, 4, 4), ("triton", 16, 32, 4, 4, 3)],
    64: [("cublas",), ("triton", 64, 64, 4, 4), ("triton", 64, 64, 4, 4, 2)],
    256: [("cublas",)],  # the Triton GEMM lost every 256-row launch of the earlier sweeps (tiles up to 128 × 256,
    # fused, split-K 1-3) to cuBLAS by 1.3-8×
}


def _copies(nbytes: int) -> int:
    """Weight copies a timing rotates through: together past 200 MB, well over the H200's
    L2 (50 MB), so every call streams its weight from HBM as decode does."""
    return 1 if DEVICE == "cpu" else max(2, min(32, -(-200_000_000 // nbytes)))


def part_tune(s: dict, batches: list[int], out: dict, iters: int) -> list[str]:
    """Per GEMM of the 8B decode step and per batch: each candidate launch of the INT4 decode
    kernel (batches ≤ 16) and of the FP8 paths, first checked against torch's float32 product of
    the dequantized operands (relative error < 1e-2, else dropped), then timed as a CUDA graph
    over copies of the weight; the fastest goes into ``lowp.TUNED`` for the parts after it."""
    from miles.models.quant import dequantize_weight, fp8_quantize_act

    g = torch.Generator(device=DEVICE).manual_seed(0)
    rows, chosen, printed = [], {}, 0
    for N, K in sorted(shapes_8b(s), key=lambda nk: -nk[0] * nk[1]):  # the largest first: a cut-off part has those
        w = torch.randn(N, K, device=DEVICE, dtype=DTYPE, generator=g) * 0.02
        w4, w8 = quantize_weight(w, INT4), quantize_weight(w, FP8)
        bf = [w] + [w.clone() for _ in range(_copies(N * K * 2) - 1)]
        c4 = [w4] + [tuple(t.clone() for t in w4) for _ in range(_copies(stored_bytes((N, K), INT4)) - 1)]
        c8 = [w8] + [tuple(t.clone() for t in w8) for _ in range(_copies(stored_bytes((N, K), FP8)) - 1)]
        ref4w = dequantize_weight(w4[0], w4[1], INT4, torch.float32)
        ref8w = dequantize_weight(w8[0], w8[1], FP8, torch.float32)
        for B in batches:
            x = torch.randn(B, K, device=DEVICE, dtype=DTYPE, generator=g)
            t_bf = _time(lambda: [F.linear(x, wi) for wi in bf], iters) / len(bf)
            rows.append(f"| {N}x{K} | {B} | bf16 | F.linear | {t_bf * 1e6:.1f} | 1.00 | |")
            trials = []
            if B <= 16:
                ref = F.linear(x.float(), ref4w)
                for cfg in INT4_CANDIDATES[1 if B == 1 else 16]:
                    fn = dict(tiled=lowp._int4_triton, gemv=lowp._int4_words, dott=lowp._int4_words).get(
                        cfg.get("path"), lowp._int4_small)
                    trials.append(("int4", cfg, cfg, ref, lambda cfg=cfg, fn=fn: [fn(x, *c, 128, cfg) for c in c4],
                                   lambda cfg=cfg, fn=fn: fn(x, *w4, 128, cfg)))
            xq, xs = fp8_quantize_act(x)
            ref = F.linear(xq.float() * xs.repeat_interleave(128, -1), ref8w)
            if DEVICE == "cuda":  # the cublas path's separate activation launch, alone (what fusing it could save)
                # 32 launches a replay: one launch alone would time the graph launch, not the kernel
                t_q = _time(lambda: [lowp._fp8_quant_triton(x, B - B % -lowp.ROWS, outer=True) for _ in range(32)],
                            iters) / 32
                rows.append(f"| {N}x{K} | {B} | fp8 | activation quantizer alone | {t_q * 1e6:.1f} | | |")
                if B >= 64:  # and cuBLAS's block-wise GEMM alone, on activations quantized beforehand
                    if not lowp._FORM:
                        lowp._FORM.append(lowp._probe(x.device, DTYPE))
                    if lowp._FORM[0] is not None:
                        mm, rows_q = lowp._mm_forms()[lowp._FORM[0]], B - B % -lowp.ROWS
                        aq, as_ = lowp._fp8_quant_triton(x, rows_q, outer="a_outer" in lowp._FORM[0])
                        t_mm = _time(lambda: [mm(aq, as_, c[0], c[1], DTYPE) for c in c8], iters) / len(c8)
                        rows.append(f"| {N}x{K} | {B} | fp8 | {lowp._FORM[0]} alone | {t_mm * 1e6:.1f} | "
                                    f"{t_bf / t_mm:.2f} | |")
            for cand in FP8_CANDIDATES.get(B, FP8_CANDIDATES[256]):
                cfg = dict(path="cublas") if cand[0] == "cublas" else dict(
                    path=cand[0], BM=cand[1], BN=cand[2], warps=cand[3], stages=cand[4],
                    **(dict(split=cand[5]) if len(cand) > 5 else {}))

                def run(cfg=cfg, c=w8):  # noqa: ANN001, ANN202
                    lowp.TUNED[("fp8", N, K, lowp._bucket(B))] = cfg
                    return lowp.fp8_linear(x, c[0], c[1], DTYPE)
                trials.append(("fp8", cfg, cfg, ref, lambda run=run: [run(c=c) for c in c8], run))
            best: dict[str, tuple[float, dict | None]] = {}
            for kind, label, cfg, ref, timed, once in trials:
                try:
                    err = float((once().float() - ref).norm() / ref.norm())
                    if not err < 1e-2:
                        rows.append(f"| {N}x{K} | {B} | {kind} | {label} | wrong | | {err:.2e} |")
                        continue
                    t = _time(timed, iters) / (len(c4) if kind == "int4" else len(c8))
                except Exception as exc:  # noqa: BLE001 - a launch that fails is reported and skipped
                    rows.append(f"| {N}x{K} | {B} | {kind} | {label} | failed: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:80] if str(exc) else ''} | | |")
                    continue
                rows.append(f"| {N}x{K} | {B} | {kind} | {label} | {t * 1e6:.1f} | {t_bf / t:.2f} | {err:.1e} |")
                if cfg is not None and t < best.get(kind, (1e9, None))[0]:
                    best[kind] = (t, cfg)
            for kind, (t, cfg) in best.items():
                lowp.TUNED[(kind, N, K, lowp._bucket(B))] = cfg
                chosen[f"{kind} {N}x{K} b{B}"] = dict(cfg=cfg, us=t * 1e6, bf16_us=t_bf * 1e6)
            if "fp8" not in best:
                lowp.TUNED[("fp8", N, K, lowp._bucket(B))] = dict(path="cublas")
        print("\n".join(rows[printed:]), flush=True)  # as it goes: a part cut off by its time limit keeps these
        printed = len(rows)
        del bf, c4, c8
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    out["tuned"] = chosen
    return ["| GEMM (N x K) | batch | kind | launch | µs per GEMM | × bf16 | rel. err |", "|---|---|---|---|---|---|---|",
            *rows, "", "Chosen (lowp.TUNED): " + json.dumps({k: v["cfg"] for k, v in chosen.items()})]


def part_kl(tiny: bool, out: dict) -> list[str]:
    """benchmarks/low_precision_kl.py on the countdown, h96 and h1024 shapes (``tiny``: a small one)."""
    from benchmarks.low_precision_kl import run

    lines, rows = run(["tiny"] if tiny else ["countdown", "h96", "h1024"])
    out["kl"] = rows
    return lines


def part_moe(s: dict, steps: int, batch: int, out: dict) -> list[str]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    h, d, E, I, G = s["hidden"], s["head_dim"], s["experts"], s["moe_inter"], 128
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()

    def rnd(*shape):  # noqa: ANN002, ANN202
        return torch.randn(*shape, device=DEVICE, dtype=DTYPE, generator=g) * 0.02

    def packed(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randint(0, 256, (E, n, k // 2), device=DEVICE, dtype=torch.uint8, generator=g)
        return q, torch.full((E, n, k // G), 0.02 / 7 * 3, device=DEVICE)

    layers = []
    for _ in range(s["layers"]):
        layers.append(dict(qkv=rnd((s["heads"] + 2 * s["kv"]) * d, h), o=rnd(h, s["heads"] * d),
                           router=rnd(E, h), gu=packed(2 * I, h), down=packed(h, I)))
    embed, head = rnd(s["vocab"], h), rnd(s["vocab"], h)
    ctx = steps + 1
    caches = [(torch.zeros(batch, s["kv"], ctx, d, device=DEVICE, dtype=DTYPE),
               torch.zeros(batch, s["kv"], ctx, d, device=DEVICE, dtype=DTYPE)) for _ in layers]
    held = (torch.cuda.memory_allocated() - base) if DEVICE == "cuda" else 0
    expert_params = s["layers"] * E * 3 * h * I
    dense_params = s["layers"] * (h * (s["heads"] + 2 * s["kv"]) * d + s["heads"] * d * h + E * h) + 2 * s["vocab"] * h
    bf16_bytes = (expert_params + dense_params) * 2
    int4_bytes = expert_params // 2 + s["layers"] * E * (2 * I * h // G + h * I // G) * 4 + dense_params * 2

    def expert_mlp(x: torch.Tensor, L: dict, e: int) -> torch.Tensor:
        gu = lowp.int4_linear(x, L["gu"][0][e], L["gu"][1][e], G)
        gate, up = gu.chunk(2, dim=-1)
        return lowp.int4_linear(F.silu(gate) * up, L["down"][0][e], L["down"][1][e], G)

    tok = torch.randint(0, s["vocab"], (batch,), device=DEVICE, generator=g)
    times, tokens = [], []
    for pos in range(steps):
        t0 = time.perf_counter()
        x = embed[tok]
        for L, (kc, vc) in zip(layers, caches):
            qkv = F.linear(F.rms_norm(x, (h,), eps=1e-6), L["qkv"])
            q, k, v = qkv.split((s["heads"] * d, s["kv"] * d, s["kv"] * d), dim=-1)
            kc[:, :, pos] = k.view(batch, s["kv"], d)
            vc[:, :, pos] = v.view(batch, s["kv"], d)
            a = F.scaled_dot_product_attention(q.view(batch, s["heads"], 1, d), kc[:, :, : pos + 1],
                                               vc[:, :, : pos + 1], enable_gqa=True)
            x = x + F.linear(a.reshape(batch, -1), L["o"])
            xn = F.rms_norm(x, (h,), eps=1e-6)
            probs = F.softmax(F.linear(xn, L["router"]).float(), -1)
            w, idx = probs.topk(s["top_k"], -1)
            w = (w / w.sum(-1, keepdim=True)).to(DTYPE)
            y = torch.zeros_like(x)
            for e in idx.unique().tolist():
                rows, slot = (idx == e).nonzero(as_tuple=True)
                y.index_add_(0, rows, expert_mlp(xn[rows], L, e) * w[rows, slot, None])
            x = x + y
        tok = F.linear(F.rms_norm(x, (h,), eps=1e-6), head).argmax(-1)
        tokens.append(tok)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ok = bool(torch.isfinite(x).all())
    peak = (torch.cuda.max_memory_allocated() - base) if DEVICE == "cuda" else 0
    step = statistics.median(times[1:] or times)
    out.update(moe_held_bytes=held, moe_peak_bytes=peak, moe_bf16_bytes=bf16_bytes, moe_int4_bytes=int4_bytes,
               moe_step_s=step, moe_finite=ok)
    total = torch.cuda.get_device_properties(0).total_memory if DEVICE == "cuda" else 0
    return [f"{s['layers']}L, {E} experts × {I}, top-{s['top_k']}, hidden {h}: INT4-expert weights "
            f"{int4_bytes / 1e9:.1f} GB (held on the device with the KV cache: {held / 1e9:.1f} GB, peak "
            f"{peak / 1e9:.1f} GB of {total / 1e9:.0f} GB) against {bf16_bytes / 1e9:.1f} GB in bf16; "
            f"decoded {steps} greedy tokens at batch {batch}, {batch / step:.1f} tok/s (eager, an expert loop), "
            f"finite: {ok}"]


def main() -> None:
    global DEVICE, DTYPE
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small shapes (the CPU check)")
    ap.add_argument("--parts", nargs="+", default=["bytes", "decode", "kl", "moe"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--moe-steps", type=int, default=16)
    ap.add_argument("--moe-batch", type=int, default=8)
    ap.add_argument("--part-timeout", type=int, default=150)
    ap.add_argument("--log", default="benchmarks/log/low_precision.md")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    s8, s30 = (TINY_8B, TINY_30B) if args.tiny else (QWEN3_8B, QWEN3_30B)
    out: dict = {}
    lines: list[str] = []
    signal.signal(signal.SIGALRM, _alarm)
    for part in args.parts:
        signal.alarm(args.part_timeout)
        t0 = time.perf_counter()
        try:
            if part == "bytes":
                got = part_bytes(s8, out)
            elif part == "decode":
                got = part_decode(s8, args.batches, out, args.iters)
            elif part == "tune":
                got = part_tune(s8, args.batches, out, args.iters)
            elif part == "kl":
                got = part_kl(args.tiny, out)
            else:
                got = part_moe(s30, args.moe_steps, args.moe_batch, out)
        except PartTimeout:
            got = [f"(timed out after {args.part_timeout} s)"]
        except Exception as exc:  # noqa: BLE001 - one part's failure is reported, the rest run
            got = [f"(failed: {type(exc).__name__}: {exc})"]
        finally:
            signal.alarm(0)
        lines += [f"### {part} ({time.perf_counter() - t0:.0f} s)", "", *got, ""]
        print("\n".join(lines[-len(got) - 3:]), flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    from benchmarks.trainer import record_section

    machine = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "CPU"
    setup = f"Shapes: {'tiny' if args.tiny else 'Qwen3-8B / Qwen3-30B-A3B'}; dtype {DTYPE}; torch {torch.__version__}"
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    record_section("low_precision", machine, setup, lines, args.log)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))


DEVICE, DTYPE = "cpu", torch.float32

if __name__ == "__main__":
    main()
