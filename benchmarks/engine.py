"""Decode throughput of the embedded engine vs Hugging Face ``generate``, side by side.

Both run in this one process on the same random checkpoint (saved once, loaded by each),
the same batch of prompts, the same dtype and device, sampling at temperature 1 with no
truncation and no early stop. For each system and batch size:

- ``total tok/s``: batch × new tokens over the wall time of the whole generate call.
- ``decode tok/s``: batch × (new − 1) over (time of an N-token run − time of a 1-token run),
  i.e. prefill removed.
- ``roofline``: (bytes of weights + bytes of the live KV cache read per decode step) / step
  time, as a fraction of the device-to-device copy bandwidth measured in the same run
  ((read + write bytes) / time of a large ``copy_``). Weights count the LM head and all
  layers; an untied embedding table counts only its looked-up rows.

On the CPU one more runs beside the default engine and its torch-ops twin: the same engine with
every GEMM on torch's BLAS thread count, where the default runs small ones on one thread
(miles.utils.blas says why). On CUDA three more engines run beside the default one: one
drawing its tokens with torch ops instead of the fused sampler, one with an ``fp8_e4m3`` KV
cache (its roofline counts its 1-byte K/V; HF's cache stays in the model's dtype, and the goals
are the default engine's), and one applying the q/k-norms and RoPE outside the decode
attention kernel (``decode_fuse_rope=False``). ``--side`` adds engines with other EngineConfig
fields, for A/B runs of an option (``--side "residual adds:decode_residual_gemm=false"``).

Usage:
  python benchmarks/engine.py --quick                       # seconds, CPU smoke
  python benchmarks/engine.py                               # CPU, tiny model (goal ≥ 3× HF)
  python benchmarks/engine.py --device cuda --preset 0.5b   # H200: batch 64 and 256, 512 new
Appends a section to benchmarks/log/engine.md (``--no-record`` to skip).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.engines import EmbeddedEngine, EngineConfig  # noqa: E402
from miles.engines.config import DECODE_ATTENTION  # noqa: E402
from miles.models import CausalLM, save_pretrained, tiny_config  # noqa: E402
from miles.types import GenerateRequest, SamplingParams  # noqa: E402
from miles.utils import blas, gcpolicy  # noqa: E402

PRESETS = {
    # A small model for the CPU: big enough that kernels matter, small enough for seconds.
    "tiny": dict(num_hidden_layers=4, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=288, max_position_embeddings=4096),
    # Where CPU matmuls, not per-step overhead, dominate (for reference; no goal attached).
    "small": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=288, max_position_embeddings=4096),
    # Qwen3-0.6B's shape (random weights): 28 layers, hidden 1024, GQA 16/8, vocab 151936, tied.
    "0.5b": dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 rope_theta=1_000_000.0, max_position_embeddings=40960),
}
GOALS = {"cpu": (3.0, None), "cuda": (10.0, 0.5)}  # (× HF decode, roofline fraction)


def build_model(preset: str, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(tiny_config(**PRESETS[preset])).eval()


def weight_bytes_per_step(model: CausalLM, batch: int) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied counted once
    if not model.config.tie_word_embeddings:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    return total


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """(read + write) bytes per second of a device-to-device copy."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * nbytes / best


def graph_us(calls: Sequence[Callable[[], object]], reps: int = 10) -> float:
    """Median µs a call of ``calls``, all captured into one CUDA graph and replayed ``reps``
    times (CUDA events): a kernel's device time as the engine's decode graphs run it. Launched
    eagerly, a call's host time can exceed its kernels' (~70 µs of Python and launches for a
    decode attention call whose kernels take ~30 µs at batch 64). Each distinct call runs once
    before the capture (compiles, workspaces, heuristics)."""
    for call in dict.fromkeys(calls):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EngineSide:
    """One engine per batch size; a full-length warm-up run first captures every CUDA graph
    the timed runs need (graphs are captured lazily, per batch and context bucket)."""

    def __init__(self, model: CausalLM, prompts: list[list[int]], new_tokens: int, args, *,
                 small_gemms_one_thread: bool = True, **config) -> None:
        cfg = EngineConfig(
            max_batch_size=len(prompts), max_seq_len=len(prompts[0]) + new_tokens + 1,
            device=args.device, dtype=args.dtype, decode_attention=args.decode_attention,
            cuda_graphs=not args.no_cuda_graphs,
            max_prefill_tokens=max(8192, len(prompts[0]) * len(prompts)),
            **{"kv_cache_dtype": args.kv_cache_dtype, **config},
        )
        self.engine = EmbeddedEngine(model, config=cfg)
        if not small_gemms_one_thread:  # every GEMM on torch's BLAS threads (miles.utils.blas)
            runner = self.engine.runner
            runner.gemm_width = 1 << 62
            if runner.cpu_kernel is not None:
                runner.cpu_kernel.set_threads = None
        self.prompts = prompts
        self.loop = asyncio.new_event_loop()
        self(new_tokens)  # warm-up

    def __call__(self, new_tokens: int) -> float:
        return self.loop.run_until_complete(self._go(new_tokens))

    async def _go(self, new_tokens: int) -> float:
        sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
        reqs = [GenerateRequest(rid=str(i), input_ids=p, sampling=sp) for i, p in enumerate(self.prompts)]
        _sync(self.engine.device)
        t = time.perf_counter()
        outs = await asyncio.gather(*(self.engine.generate(r) for r in reqs))
        _sync(self.engine.device)
        elapsed = time.perf_counter() - t
        bad = [o.error or o.finish_reason for o in outs if len(o.output_ids) != new_tokens]
        assert not bad, bad[:3]
        return elapsed

    def rollout(self, prompts: list[list[int]], lengths: list[int], *, admit_each: bool = False) -> float:
        """``admit_each``: admit every waiting request at the next step (one prefill per
        arrival, the engine's behaviour before ``EngineConfig.admit_min``) instead of the
        default batched admission."""
        cfg = self.engine.config
        saved = cfg.admit_min, cfg.admit_max_wait_steps
        if admit_each:
            cfg.admit_min, cfg.admit_max_wait_steps = 1, 0
        try:
            return self.loop.run_until_complete(self._rollout(prompts, lengths))
        finally:
            cfg.admit_min, cfg.admit_max_wait_steps = saved

    async def _rollout(self, prompts: list[list[int]], lengths: list[int]) -> float:
        reqs = [GenerateRequest(rid=f"r{i}", input_ids=p, sampling=SamplingParams(
            max_new_tokens=n, temperature=1.0, ignore_eos=True)) for i, (p, n) in enumerate(zip(prompts, lengths))]
        _sync(self.engine.device)
        t = time.perf_counter()
        outs = await asyncio.gather(*(self.engine.generate(r) for r in reqs))
        _sync(self.engine.device)
        assert [len(o.output_ids) for o in outs] == lengths
        return time.perf_counter() - t

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()


def hf_rollout(hf, prompts: list[list[int]], lengths: list[int], batch: int, device: torch.device) -> float:
    """HF generate over consecutive static batches; a batch runs until its longest response
    is done (as generate does when rows stop at different EOS positions)."""
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        run_hf(hf, prompts[i : i + batch], max(lengths[i : i + batch]), device, warm=False)
    return time.perf_counter() - t


def run_hf(hf, prompts: list[list[int]], new_tokens: int, device: torch.device, warm: bool = True) -> float:
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    with torch.no_grad():
        if warm:
            hf.generate(ids[:1], **{**kw, "attention_mask": mask[:1], "max_new_tokens": 2, "min_new_tokens": 2})
        _sync(device)
        t = time.perf_counter()
        out = hf.generate(ids, **kw)
        _sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - t


def measure(systems: dict, batch: int, new_tokens: int, repeats: int) -> list[dict]:
    """Best-of-``repeats`` times for each system, runs interleaved (a shared machine's load
    then hits both sides alike)."""
    best = {name: [float("inf"), float("inf")] for name in systems}
    for _ in range(repeats):
        for name, fn in systems.items():
            best[name][0] = min(best[name][0], fn(new_tokens))
            best[name][1] = min(best[name][1], fn(1))
    rows = []
    for name, (t_n, t_1) in best.items():
        decode = max(t_n - t_1, 1e-9)
        rows.append(dict(system=name, batch=batch, total_s=t_n, total_tps=batch * new_tokens / t_n,
                         decode_tps=batch * (new_tokens - 1) / decode, step_s=decode / (new_tokens - 1)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--decode-attention", default="auto", choices=DECODE_ATTENTION)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face side")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine's KV cache (auto, fp8_e4m3, fp8_e5m2)")
    ap.add_argument("--no-fp8-kv", action="store_true",
                    help="on CUDA, skip the side run of the same engine with an fp8_e4m3 KV cache")
    ap.add_argument("--no-torch-ops", action="store_true",
                    help="skip the engine run through torch ops: the CPU's decode step without the C "
                         "kernel, CUDA's sampling without the fused Triton draw")
    ap.add_argument("--no-rope-outside", action="store_true",
                    help="skip the engine with q/k-norm + RoPE outside the decode attention kernel (CUDA)")
    ap.add_argument("--side", action="append", default=[], metavar="NAME:FIELD=VALUE[,FIELD=VALUE]",
                    help="one more engine beside the default one, with these EngineConfig fields "
                         "(e.g. 'residual adds:decode_residual_gemm=false'); repeatable")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--repeats", type=int, default=None, help="best of N interleaved runs")
    ap.add_argument("--workload", choices=["decode", "rollout", "both"], default="decode",
                    help="decode: same batch, fixed length (the goal figures); rollout: 4×batch "
                         "requests of varied length (continuous batching vs static batches)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "engine.md"))
    args = ap.parse_args()
    gcpolicy.install()  # the GC of a rollout worker's process (both systems run under it)
    cuda = torch.device(args.device).type == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    args.preset = args.preset or ("0.5b" if cuda else "tiny")
    args.batch = args.batch or ([4] if args.quick else [64, 256] if cuda else [8, 32])
    args.new_tokens = args.new_tokens or (16 if args.quick else 512 if cuda else 128)
    args.prompt_len = args.prompt_len or (16 if args.quick else 128 if cuda else 32)
    args.repeats = args.repeats or (1 if args.quick else 2 if cuda else 3)
    rows, roof = bench(args)
    report(args, rows, roof)


def bench(args) -> tuple[list[dict], dict]:
    device = torch.device(args.device)
    dtype = EngineConfig(device=args.device, dtype=args.dtype).torch_dtype()
    model = build_model(args.preset)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    hf = None
    if not args.no_hf:
        import transformers

        tmp = tempfile.mkdtemp(prefix="miles-bench-")
        save_pretrained(model, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
    engine_model = model.to(device=device, dtype=dtype)
    bw = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 28)
    kv_per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * \
        model.config.head_dim * torch.finfo(dtype).bits // 8
    rows: list[dict] = []
    for batch in args.batch:
        prompts = torch.randint(5, V, (batch, args.prompt_len), generator=g).tolist()
        side = EngineSide(engine_model, prompts, args.new_tokens, args)
        systems = {"embedded": side}
        torch_ops = None
        if device.type == "cpu" and side.engine.runner.cpu_kernel is not None and not args.no_torch_ops:
            # the same engine with its decode step through torch ops: what the C kernel buys
            torch_ops = EngineSide(engine_model, prompts, args.new_tokens, args, cpu_decode_kernel=False)
            systems["embedded, torch ops"] = torch_ops
        blas_threads = None
        if device.type == "cpu" and blas.set_threads_address() and not args.no_torch_ops:
            # the same engine with every GEMM on torch's BLAS threads: what one thread for
            # small GEMMs on the stepping thread buys (miles.utils.blas)
            blas_threads = EngineSide(engine_model, prompts, args.new_tokens, args, small_gemms_one_thread=False)
            systems["embedded, all GEMMs on torch's threads"] = blas_threads
        torch_sampling = None
        if side.engine.stepper.fused_sampling and not args.no_torch_ops:
            # the same engine drawing its tokens with torch ops: what the fused sampler buys
            torch_sampling = EngineSide(engine_model, prompts, args.new_tokens, args, fused_sampling=False)
            systems["embedded, torch sampling"] = torch_sampling
        fp8_kv = None
        if device.type == "cuda" and args.kv_cache_dtype == "auto" and not args.no_fp8_kv:
            # the same engine with an 8-bit KV cache: half the bytes of the step's largest read
            fp8_kv = EngineSide(engine_model, prompts, args.new_tokens, args, kv_cache_dtype="fp8_e4m3")
            systems["embedded, fp8 KV cache"] = fp8_kv
        rope_outside = None
        if side.engine.runner.attention == "triton" and not args.no_rope_outside:
            # the same engine with the q/k-norms and RoPE in the compiled layer functions: what
            # applying them inside the decode attention kernel buys (decode_fuse_rope)
            rope_outside = EngineSide(engine_model, prompts, args.new_tokens, args, decode_fuse_rope=False)
            systems["embedded, RoPE outside attention"] = rope_outside
        extra = {name: EngineSide(engine_model, prompts, args.new_tokens, args, **fields)
                 for name, fields in map(parse_side, args.side)}
        systems.update((f"embedded, {name}", side_) for name, side_ in extra.items())
        kv_bytes = {name: sys_.engine.runner.cache.bytes_per_token() for name, sys_ in systems.items()}
        if hf is not None:
            systems["hf generate"] = lambda n: run_hf(hf, prompts, n, device)
        found = measure(systems, batch, args.new_tokens, args.repeats) if args.workload != "rollout" else []
        if args.workload in ("rollout", "both"):
            found += rollout_rows(side, hf, batch, args, device, V, g)
        side.close()
        for other in (torch_ops, blas_threads, torch_sampling, fp8_kv, rope_outside, *extra.values()):
            if other is not None:
                other.close()
        del side, systems, torch_ops, blas_threads, torch_sampling, fp8_kv, rope_outside, extra
        mean_ctx = args.prompt_len + args.new_tokens / 2
        for row in found:
            if "step_s" in row:  # each system's own KV bytes (HF's cache is in the model's dtype)
                kv = kv_bytes.get(row["system"], kv_per_token)
                row["roofline"] = (weight_bytes_per_step(engine_model, batch) + batch * mean_ctx * kv) / row["step_s"] / bw
        decode = {r["system"]: r for r in found if "step_s" in r}
        if "hf generate" in decode:
            for name, row in decode.items():
                if name != "hf generate":
                    row["vs_hf"] = row["decode_tps"] / decode["hf generate"]["decode_tps"]
        rows += found
    n_params = sum(p.numel() for p in engine_model.parameters())
    return rows, dict(copy_bw=bw, params=n_params, dtype=str(dtype).removeprefix("torch."))


def parse_side(spec: str) -> tuple[str, dict]:
    """``--side``'s ``NAME:FIELD=VALUE,...`` → (name, EngineConfig fields); values are YAML
    scalars (true, 0, fp8_e4m3), each checked against the field's type."""
    name, _, fields = spec.partition(":")
    out = {}
    for item in filter(None, fields.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in EngineConfig.__struct_fields__:
            raise SystemExit(f"--side {spec!r}: {item!r} is not FIELD=VALUE of an EngineConfig field")
        out[key] = yaml.safe_load(value)
    msgspec.convert(out, EngineConfig)  # a wrong type fails here, not mid-run
    if not name or not out:
        raise SystemExit(f"--side {spec!r}: expected NAME:FIELD=VALUE[,FIELD=VALUE]")
    return name, out


def rollout_rows(side: EngineSide, hf, batch: int, args, device, V: int, g) -> list[dict]:
    """An RL-style workload: 4 × batch requests whose responses stop at lengths uniform in
    [new/8, new]; the engine keeps ``batch`` slots full, HF runs static batches."""
    n_req = 4 * batch
    prompts = torch.randint(5, V, (n_req, args.prompt_len), generator=g).tolist()
    lengths = torch.randint(max(1, args.new_tokens // 8), args.new_tokens + 1, (n_req,), generator=g).tolist()
    useful = sum(lengths)
    t_eng = t_each = float("inf")
    for _ in range(args.repeats):  # batched admission (the default) and one prefill per arrival, interleaved
        t_eng = min(t_eng, side.rollout(prompts, lengths))
        t_each = min(t_each, side.rollout(prompts, lengths, admit_each=True))
    rows = [dict(system="embedded", workload="rollout", batch=batch, requests=n_req, total_s=t_eng,
                 total_tps=useful / t_eng, vs_admit_each=t_each / t_eng),
            dict(system="embedded, admit each arrival", workload="rollout", batch=batch, requests=n_req,
                 total_s=t_each, total_tps=useful / t_each)]
    if hf is not None:
        t_hf = min(hf_rollout(hf, prompts, lengths, batch, device) for _ in range(args.repeats))
        rows.append(dict(system="hf generate", workload="rollout", batch=batch, requests=n_req,
                         total_s=t_hf, total_tps=useful / t_hf))
        rows[0]["vs_hf_rollout"] = t_hf / t_eng
    return rows


def machine() -> str:
    desc = f"{platform.platform()}, {platform.processor() or platform.machine()}, " \
           f"{torch.get_num_threads()} torch threads, torch {torch.__version__}"
    if torch.cuda.is_available():
        desc += f", {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return desc


def report(args, rows: list[dict], info: dict) -> None:
    decode = [r for r in rows if "step_s" in r]
    lines = ["| system | batch | total s | total tok/s | decode tok/s | step ms | roofline | × HF |",
             "|---|---|---|---|---|---|---|---|"] if decode else []
    for r in decode:
        vs = f"{r['vs_hf']:.2f}×" if "vs_hf" in r else ""
        lines.append(f"| {r['system']} | {r['batch']} | {r['total_s']:.2f} | {r['total_tps']:.0f} | "
                     f"{r['decode_tps']:.0f} | {1000 * r['step_s']:.2f} | {100 * r['roofline']:.1f}% | {vs} |")
    rollout = [r for r in rows if r.get("workload") == "rollout"]
    if rollout:
        lines += [""] * bool(lines) + ["| rollout workload | slots | requests | total s | useful tok/s | × HF | × admit each |",
                  "|---|---|---|---|---|---|---|"]
        for r in rollout:
            vs = f"{r['vs_hf_rollout']:.2f}×" if "vs_hf_rollout" in r else ""
            each = f"{r['vs_admit_each']:.2f}×" if "vs_admit_each" in r else ""
            lines.append(f"| {r['system']} | {r['batch']} | {r['requests']} | {r['total_s']:.2f} | "
                         f"{r['total_tps']:.0f} | {vs} | {each} |")
    goal_x, goal_roof = GOALS["cuda" if torch.device(args.device).type == "cuda" else "cpu"]
    verdicts = []
    for r in rows:
        if r["system"] != "embedded" or "step_s" not in r:
            continue
        if r.get("roofline", 0) > 1.0:  # faster than copying its bytes: the measurement, not the engine
            verdicts.append(f"batch {r['batch']}: NOT a valid measurement: {100 * r['roofline']:.0f}% of the copy "
                            "bandwidth. The decode time is the N-token run less the 1-token run (prefill and one "
                            "step), so a stall in the latter shrinks it; run again with more --repeats")
            continue
        if "vs_hf" in r:
            ok = r["vs_hf"] >= goal_x
            verdicts.append(f"batch {r['batch']}: {r['vs_hf']:.2f}× HF decode (goal ≥ {goal_x:g}×: "
                            f"{'met' if ok else 'NOT met'})")
            if r.get("roofline"):  # the most any engine reading these bytes could reach against this HF
                verdicts.append(f"batch {r['batch']}: at 100% of the roofline the step would be "
                                f"{r['vs_hf'] / r['roofline']:.1f}× HF (the bound on × HF for these bytes)")
        if goal_roof is not None:
            ok = r["roofline"] >= goal_roof
            verdicts.append(f"batch {r['batch']}: {100 * r['roofline']:.1f}% of copy-bandwidth roofline "
                            f"(goal ≥ {100 * goal_roof:.0f}%: {'met' if ok else 'NOT met'})")
    steps = {(r["system"], r["batch"]): r["step_s"] for r in rows if "step_s" in r}
    verdicts += [f"batch {b}: a decode step with the fused sampler {1e3 * steps[('embedded', b)]:.2f} ms against "
                 f"{1e3 * t:.2f} ms with torch sampling ({t / steps[('embedded', b)]:.2f}×; no goal)"
                 for (name, b), t in steps.items() if name == "embedded, torch sampling" and ("embedded", b) in steps]
    verdicts += [f"batch {b}: a decode step with q/k-norm + RoPE in the attention kernel "
                 f"{1e3 * steps[('embedded', b)]:.2f} ms against {1e3 * t:.2f} ms with them outside "
                 f"({t / steps[('embedded', b)]:.2f}×; no goal)"
                 for (name, b), t in steps.items()
                 if name == "embedded, RoPE outside attention" and ("embedded", b) in steps]
    sides = {f"embedded, {name}" for name, _ in map(parse_side, args.side)}
    verdicts += [f"batch {b}: {name.removeprefix('embedded, ')}: a step {1e3 * t:.2f} ms against the default "
                 f"engine's {1e3 * steps[('embedded', b)]:.2f} ms ({steps[('embedded', b)] / t:.2f}× its speed; no goal)"
                 for (name, b), t in steps.items() if name in sides and ("embedded", b) in steps]
    verdicts += [f"batch {r['batch']}: with an fp8_e4m3 KV cache {r['vs_hf']:.2f}× HF decode, a step "
                 f"{steps[('embedded', r['batch'])] / r['step_s']:.2f}× faster than the default engine's "
                 f"(the goal is the default engine's; HF's cache is {info['dtype']})"
                 for r in rows if r["system"] == "embedded, fp8 KV cache" and "vs_hf" in r
                 and ("embedded", r["batch"]) in steps]
    verdicts += [f"rollout, {r['batch']} slots: {r['vs_hf_rollout']:.2f}× HF useful tokens/s (no goal)"
                 for r in rollout if "vs_hf_rollout" in r]
    cmd = "python benchmarks/engine.py " + " ".join(sys.argv[1:])
    desc = (f"preset {args.preset} ({info['params'] / 1e6:.1f}M params, {info['dtype']}), prompt "
            f"{args.prompt_len} tokens, {args.new_tokens} new tokens, temperature 1, no early stop; "
            f"copy bandwidth {info['copy_bw'] / 1e9:.1f} GB/s (read+write)")
    text = "\n".join(lines)
    print(desc)
    print(text)
    print("\n".join(verdicts))
    if args.no_record:
        return
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    section = [f"\n## engine — {stamp}{' (quick)' if args.quick else ''}", "",
               f"Command: `{cmd}`  ", f"Machine: {machine()}  ",
               "The machine was shared with other engineers' jobs; both systems ran side by side "
               "in one process, so the ratios are the figures to read.  ", desc, "", text, ""]
    section += [f"- {v}" for v in verdicts] + [""]
    with open(args.results, "a", encoding="utf-8") as fh:
        fh.write("\n".join(section))
    print(f"appended to {args.results}")


if __name__ == "__main__":
    main()
