"""--true-on-policy on a device: the exact zero, and what it costs the engine's decode.

For each shape (random weights; ``dense``: Qwen3-0.6B's, ``moe``: a small Qwen3-MoE):

- **exactness**: an embedded engine (bf16 on CUDA, 8 slots) generates for 12 requests of
  different prompt lengths and response lengths (continuous batching: rows join as others
  leave), then an EmbeddedTrainer holding the float32 master weights recomputes their
  log-probs (bf16 autocast) and takes one train step (sync: the version that sampled them).
  Reported: max |Δ log-prob| of the direct recompute and the step's
  ``train/rollout_logprob_abs_diff_max`` / ``train/tis_ratio_max``, in the mode and, for
  contrast, without it (the default engine: compiled layers, cuBLAS, fused sampler).
- **throughput**: decode tok/s (batch × (N − 1) / (t_N − t_1): prefill removed) of the
  default engine and of the engine in the mode, at each batch, timed alternately over
  ``--rounds`` rounds; the median ratio and its range (goal ≥ 0.7×).

Usage:
  python benchmarks/true_on_policy.py --quick                 # CPU smoke (float32, tiny shapes)
  python benchmarks/true_on_policy.py --device cuda           # H200: dense + moe, batch 64 and 256
Prints a compact summary and appends a section to benchmarks/log/true_on_policy.md (``--no-record``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (the trainer's backward), as configure_process
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.algorithms import AlgorithmConfig  # noqa: E402
from miles.engines import EmbeddedEngine, EngineConfig  # noqa: E402
from miles.models import CausalLM, invariant, tiny_config  # noqa: E402
from miles.trainers import EmbeddedTrainer, TrainerConfig  # noqa: E402
from miles.types import GenerateRequest, SamplingParams, Trajectory  # noqa: E402

SHAPES = {
    "dense": dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                  rope_theta=1_000_000.0, max_position_embeddings=40960),
    "moe": dict(model_type="qwen3_moe", num_hidden_layers=8, hidden_size=1024, intermediate_size=3072,
                moe_intermediate_size=512, num_experts=16, num_experts_per_tok=4, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                rope_theta=1_000_000.0, max_position_embeddings=40960),
}
QUICK = {
    "dense": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=288, max_position_embeddings=512),
    "moe": dict(model_type="qwen3_moe", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=288, max_position_embeddings=512),
}
GOAL = 0.7
# The engine options --true-on-policy sets (miles.actors.factory.build_engine).
MODE_ENGINE = dict(decode_attention="sdpa", cpu_decode_kernel=False, decode_residual_gemm=False,
                   decode_fused_mlp=False, compile=False)


def build_model(shape: dict, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(tiny_config(initializer_range=0.02, **shape))


def _run(engine: EmbeddedEngine, reqs: list[GenerateRequest]) -> list[Any]:
    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    return asyncio.run(go())


def _trajectories(prompts: list[list[int]], outs: list[Any]) -> list[Trajectory]:
    trajs = []
    for i, (p, out) in enumerate(zip(prompts, outs)):
        if out.error:
            raise RuntimeError(f"request {i}: {out.error}")
        t = Trajectory(id=f"t{i}", prompt_id=f"p{i // 2}", group_id=f"g{i // 2}", prompt_tokens=p)
        t.append(out.output_ids, out.logprobs, out.versions)
        t.routed_experts = out.routed_experts
        t.reward = float(i % 2)
        trajs.append(t)
    return trajs


def exactness(shape: dict, device: str, true_on_policy: bool, *, requests: int = 12, slots: int = 8,
              seed: int = 0) -> dict:
    """The engine's recorded log-probs vs the trainer's recompute (and one sync train step)."""
    moe = shape.get("model_type") == "qwen3_moe"
    model = build_model(shape, seed).to(device)
    g = torch.Generator().manual_seed(seed)
    V = shape["vocab_size"]
    prompts = [torch.randint(3, V, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(requests)]
    lengths = [int(torch.randint(6, 40, (1,), generator=g)) for _ in range(requests)]
    extra = MODE_ENGINE if true_on_policy else {}
    with _mode(true_on_policy, shape["max_position_embeddings"], device):
        engine = EmbeddedEngine(copy.deepcopy(model).eval(), config=EngineConfig(
            max_batch_size=slots, max_seq_len=128, device=device, seed=seed, **extra))
        try:
            reqs = [GenerateRequest(rid=f"r{i}", input_ids=p, sampling=SamplingParams(
                max_new_tokens=n, temperature=1.0, ignore_eos=True, seed=seed + i), return_routed_experts=moe)
                for i, (p, n) in enumerate(zip(prompts, lengths))]
            trajs = _trajectories(prompts, _run(engine, reqs))
        finally:
            asyncio.run(engine.close())
        tr = EmbeddedTrainer(model, config=TrainerConfig(lr=1e-6, device=device, use_rollout_routing_replay=moe,
                                                         compile=False),
                             algo=AlgorithmConfig(use_tis=True))
        got = tr.compute_logprobs(trajs)
        diffs = torch.cat([(torch.tensor(a, dtype=torch.float64) - torch.tensor(t.logprobs, dtype=torch.float64)).abs()
                           for a, t in zip(got, trajs)])
        r = {"max_abs_diff": float(diffs.max()), "bitwise_frac": float((diffs == 0).double().mean()),
             "tokens": int(diffs.numel()), "step_abs_diff_max": float("nan"), "tis_ratio_max": float("nan")}
        try:
            m = tr.train_step([trajs[i : i + 2] for i in range(0, len(trajs), 2)])
            r.update(step_abs_diff_max=float(m["train/rollout_logprob_abs_diff_max"]),
                     tis_ratio_max=float(m.get("train/tis_ratio_max", float("nan"))))
        except Exception as e:  # the recompute's figure stands; say why the step did not run
            traceback.print_exc()
            r["step_error"] = f"{type(e).__name__}: {e}"[:300]
    return r


@contextlib.contextmanager
def _mode(on: bool, keys: int, device: str):
    """The mode as an actor process runs it (miles.actors.factory.configure_process):
    deterministic algorithms and the batch-invariant functions; nothing when ``on`` is False."""
    if not on:
        yield
        return
    torch.use_deterministic_algorithms(True, warn_only=torch.device(device).type == "cuda")
    fill = torch.utils.deterministic.fill_uninitialized_memory
    invariant.skip_uninitialized_fill()
    try:
        with invariant.mode(keys=keys, device=device):
            yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def decode_rounds(model: CausalLM, device: str, batch: int, prompt_len: int, new_tokens: int, rounds: int,
                  cuda_graphs: bool = True) -> dict[str, Any]:
    """Decode tok/s of the default engine and of the engine in the mode, ``batch`` slots over
    ``batch`` requests (prefill removed): both engines built once, then timed alternately
    (default, mode, default, ...) for ``rounds`` rounds, so a slow spell of the machine (a
    small batch's step is partly the host's) hits both. Returns each round's figures."""
    engines: dict[bool, EmbeddedEngine] = {}
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=g).tolist()

    def timed(on: bool, n: int) -> float:
        sp = SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)
        reqs = [GenerateRequest(rid=f"{n}-{i}", input_ids=p, sampling=sp) for i, p in enumerate(prompts)]
        with _mode(on, model.config.max_position_embeddings, device):
            _sync(device)
            t = time.perf_counter()
            outs = _run(engines[on], reqs)
            _sync(device)
        assert all(len(o.output_ids) == n for o in outs), [o.error or o.finish_reason for o in outs][:3]
        return time.perf_counter() - t

    def tps(on: bool) -> float:
        t1 = min(timed(on, 1) for _ in range(2))
        return batch * (new_tokens - 1) / max(timed(on, new_tokens) - t1, 1e-9)

    try:
        for on in (False, True):
            extra = MODE_ENGINE if on else {}
            with _mode(on, model.config.max_position_embeddings, device):
                engines[on] = EmbeddedEngine(copy.deepcopy(model).eval(), config=EngineConfig(
                    max_batch_size=batch, max_seq_len=prompt_len + new_tokens + 1, device=device,
                    cuda_graphs=cuda_graphs, max_prefill_tokens=max(8192, prompt_len * batch), **extra))
            timed(on, new_tokens)  # warm-up: kernels compiled, graphs captured
        figures: dict[str, Any] = {"default_tps": [], "mode_tps": []}
        for _ in range(rounds):
            figures["default_tps"].append(tps(False))
            figures["mode_tps"].append(tps(True))
    finally:
        for engine in engines.values():
            asyncio.run(engine.close())
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shapes", nargs="+", default=["dense", "moe"], choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="alternated default/mode timings per batch")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (the CPU smoke)")
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "true_on_policy.md"))
    args = ap.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    batches = args.batch or ([64, 256] if cuda and not args.quick else [4])
    new_tokens = args.new_tokens or (128 if cuda and not args.quick else 8)
    shapes = QUICK if args.quick else SHAPES
    rows: list[dict] = []
    for name in args.shapes:
        shape = shapes[name]
        for mode in (True, False):
            t = time.perf_counter()
            try:
                r = exactness(shape, args.device, mode)
            except Exception as e:  # report and go on: one failure must not hide the other figures
                traceback.print_exc()
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
            r.update(shape=name, part="exact", mode="true_on_policy" if mode else "default",
                     wall_s=round(time.perf_counter() - t, 1))
            rows.append(r)
            print(json.dumps(r), flush=True)
        if args.no_throughput:
            continue
        model = build_model(shape).to(args.device)
        for batch in batches:
            r = {"shape": name, "part": "decode", "batch": batch, "new_tokens": new_tokens}
            t = time.perf_counter()
            try:
                try:
                    f = decode_rounds(model, args.device, batch, args.prompt_len, new_tokens, args.rounds)
                    r["mode_graphs"] = cuda
                except Exception as e:  # CUDA graphs that do not capture the mode's kernels: say so, run eager
                    traceback.print_exc()
                    r["graphs_error"] = f"{type(e).__name__}: {e}"[:300]
                    f = decode_rounds(model, args.device, batch, args.prompt_len, new_tokens, args.rounds,
                                      cuda_graphs=False)
                    r["mode_graphs"] = False
                ratios = sorted(m / d for d, m in zip(f["default_tps"], f["mode_tps"]))
                r.update(default_tps=statistics.median(f["default_tps"]), mode_tps=statistics.median(f["mode_tps"]),
                         ratio=statistics.median(ratios), ratio_min=ratios[0], ratio_max=ratios[-1],
                         rounds=f)
                r["goal_met"] = r["ratio"] >= GOAL
            except Exception as e:
                traceback.print_exc()
                r["error"] = f"{type(e).__name__}: {e}"[:300]
            r["wall_s"] = round(time.perf_counter() - t, 1)
            rows.append(r)
            print(json.dumps(r), flush=True)
        del model
    print("\nsummary:")
    for r in rows:
        if r["part"] == "exact":
            print(f"  {r['shape']:5s} {r['mode']:14s} " + ("ERROR " + r["error"] if "error" in r else
                  f"max|Δ|={r['max_abs_diff']:.3g} bitwise={r['bitwise_frac']:.1%} of {r['tokens']} "
                  f"step max|Δ|={r['step_abs_diff_max']:.3g} tis_max={r['tis_ratio_max']:.6g}"
                  + (f" step_error={r['step_error']}" if "step_error" in r else "")))
        else:
            print(f"  {r['shape']:5s} decode batch {r['batch']}: " + ("ERROR " + r["error"] if "error" in r else
                  f"default {r['default_tps']:.0f} tok/s, mode {r['mode_tps']:.0f} tok/s "
                  f"(graphs {r['mode_graphs']}) ratio {r['ratio']:.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] "
                  f"over {len(r['rounds']['mode_tps'])} rounds (goal >= {GOAL})"))
    if not args.no_record:
        path = Path(args.results)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            dev = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
            f.write(f"\n## {stamp} · {dev} · torch {torch.__version__}\n\n`{' '.join(sys.argv)}`\n\n")
            for r in rows:
                f.write(f"- {json.dumps(r)}\n")
    exact = [r for r in rows if r["part"] == "exact" and r["mode"] == "true_on_policy"]
    ok = all(r.get("max_abs_diff") == 0.0 and r.get("step_abs_diff_max") == 0.0 for r in exact)
    print("exact zero in the mode:", "yes" if ok else "NO")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
