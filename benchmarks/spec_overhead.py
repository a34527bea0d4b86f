"""What a draft costs while speculation is off: the plain engine against a speculative engine
that never speculates (the batch is above --speculative-max-batch-size) and one with the
adaptive rule, side by side in one process.

    python benchmarks/spec_overhead.py                                # CPU, tiny model
    python benchmarks/spec_overhead.py --device cuda --preset 0.5b    # H200

Why: where speculation does not pay (large batches) the engine switches it off by itself,
but an engine that carries a draft still keeps the draft's state: EAGLE feeds the policy's
hidden states of plain steps to its head every ~31 steps (a drain and a forward); an
independent LM draft is fed its backlog of context tokens at the next round only. The
"capped" column is that cost alone; "adaptive" adds the rule's exploration. Random weights
(the draft's quality does not matter for the capped engine); every request decodes
--new-tokens tokens (EOS ignored). Appends its table to benchmarks/log/spec_overhead.md.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import build_model, machine  # noqa: E402
from benchmarks.trainer import record_section  # noqa: E402
from miles.engines import EmbeddedEngine, EngineConfig  # noqa: E402
from miles.engines.spec import SpeculativeConfig  # noqa: E402
from miles.models.draft import build_draft  # noqa: E402
from miles.types import GenerateRequest, SamplingParams  # noqa: E402


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


async def timed(engine: EmbeddedEngine, batch: int, new_tokens: int, tag: str, device: str) -> float:
    reqs = [GenerateRequest(rid=f"{tag}-{i}", input_ids=[5 + i % 200, 6, 7, 8, 9, 10, 11, 12],
                            sampling=SamplingParams(max_new_tokens=new_tokens, seed=i, ignore_eos=True))
            for i in range(batch)]
    _sync(device)
    t = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
    _sync(device)
    assert all(len(o.output_ids) == new_tokens for o in outs), [o.error for o in outs if o.error][:2]
    return time.perf_counter() - t


async def measure(args, kind: str, batch: int) -> dict[str, float]:
    policy = build_model(args.preset)
    draft = build_draft(kind, policy.config, seed=1)
    cfg = EngineConfig(max_batch_size=batch, max_seq_len=args.new_tokens + 64, device=args.device)

    def spec(**kw) -> SpeculativeConfig:
        return SpeculativeConfig(speculative_algorithm=kind, speculative_num_steps=args.k, **kw)

    engines = {
        "plain": EmbeddedEngine(copy.deepcopy(policy), config=cfg),
        "capped": EmbeddedEngine(copy.deepcopy(policy), config=cfg, draft=copy.deepcopy(draft),
                                 speculative=spec(speculative_max_batch_size=1)),
        "adaptive": EmbeddedEngine(copy.deepcopy(policy), config=cfg, draft=copy.deepcopy(draft), speculative=spec()),
    }
    best = {name: float("inf") for name in engines}
    for rep in range(args.repeats + 1):  # the first run warms up (graphs, compiles, the rule)
        for name, engine in engines.items():
            t = await timed(engine, batch, args.new_tokens, f"{name}{rep}", args.device)
            if rep:
                best[name] = min(best[name], t)
    stats = engines["adaptive"].stats()
    frac, probes = stats.get("spec/spec_step_frac", 0.0), stats.get("spec/probes", 0.0)
    for engine in engines.values():
        await engine.close()
    tokens = batch * args.new_tokens
    return {"kind": kind, "batch": batch, **{f"{n}_tps": tokens / t for n, t in best.items()}, "spec_frac": frac,
            "probes": probes}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--kinds", nargs="+", default=["draft", "eagle"])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "spec_overhead.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    args.preset = args.preset or ("0.5b" if cuda else "tiny")
    batches = args.batches or ([64, 256] if cuda else [16, 64])
    rows = []
    for kind in args.kinds:
        for batch in batches:
            rows.append(await measure(args, kind, batch))
            r = rows[-1]
            print(f"{kind} batch {batch}: plain {r['plain_tps']:.0f}, capped {r['capped_tps']:.0f}, "
                  f"adaptive {r['adaptive_tps']:.0f} tok/s", flush=True)
    lines = ["| draft | batch | plain tok/s | capped tok/s | capped ÷ plain | adaptive tok/s | adaptive ÷ plain | "
             "adaptive spec steps | adaptive probes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['batch']} | {r['plain_tps']:.0f} | {r['capped_tps']:.0f} | "
                     f"{r['capped_tps'] / r['plain_tps']:.2f}× | {r['adaptive_tps']:.0f} | "
                     f"{r['adaptive_tps'] / r['plain_tps']:.2f}× | {100 * r['spec_frac']:.0f}% | {r['probes']:.0f} |")
    record_section("spec_overhead", machine(), (
        f"preset {args.preset}, k = {args.k}, prompt 8 + {args.new_tokens} new tokens, temperature 1, random "
        f"weights; best of {args.repeats} after a warm-up, engines interleaved. 'capped': a speculative engine "
        "whose --speculative-max-batch-size (1) is below the batch, so it never speculates."),
        lines, args.results, save=not args.no_record)


if __name__ == "__main__":
    asyncio.run(main())
