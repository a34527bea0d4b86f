"""Speculative rollouts while the policy learns: no speculation vs a frozen draft vs a draft
trained online by the DraftTrainer, side by side in one process.

The loop (in-process, no Ray, to keep it controlled): three embedded engines hold the same
policy — ``plain`` (no speculation), ``frozen`` (draft D0, never updated) and ``online``
(draft D0, updated by a DraftTrainer through a draft-channel WeightBroadcaster). D0 is
first distilled on the initial policy's samples. Each RL step:

1. every engine generates the same batch (same prompts, seeds, lengths; rejection-mode
   speculation, so the tokens differ but the law is the policy's) — timed side by side;
2. the online engine's trajectories (speculative tokens, policy log-probs and versions)
   are scored and trained on: one GRPO step of an EmbeddedTrainer with a learning rate
   high enough to move the policy, and — concurrently — a DraftTrainer pass on the same
   batch;
3. the new policy version goes to all three engines; the new draft version to ``online``.

Acceptance length (tokens a request emits per verify round) is read per policy version
from each engine (``EmbeddedEngine.spec_stats``) and plotted. Then a batch-size sweep at
the final policy compares rollout tokens/s without speculation, with the engine's
adaptive rule (``--speculative-adaptive``) and with speculation forced on.

The policy is synthetic so that a small draft *can* learn it and RL visibly moves it:
random weights with large embeddings and small layers (the next token depends mostly on
the last one, with some context), confined to ``--active-vocab`` token ids by a constant
hidden channel that lifts their logits; the reward is the fraction of response tokens in
a fixed quarter of the active ids, which GRPO pushes the transition table towards.

Usage:
  python benchmarks/speculative.py --quick                  # ~1-2 min CPU smoke
  python benchmarks/speculative.py                          # CPU: acceptance curves (+ tok/s)
  python benchmarks/speculative.py --device cuda            # H200: 0.5B-shaped policy, batch 1..64
Appends a section to benchmarks/log/speculative.md (``--no-record`` to skip) and writes a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import gc
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.actors.draft_trainer import DraftTrainer, apply_draft_buckets  # noqa: E402
from miles.actors.weight_broadcaster import WeightBroadcaster  # noqa: E402
from miles.algorithms import AlgorithmConfig  # noqa: E402
from miles.engines import EmbeddedEngine, EngineConfig  # noqa: E402
from miles.engines.runner import GRAPH_CAPTURES  # noqa: E402
from miles.engines.spec import SpeculativeConfig  # noqa: E402
from miles.engines.spec.controller import bucket  # noqa: E402
from miles.models import CausalLM, ModelConfig, tiny_config  # noqa: E402
from miles.models.draft import build_draft  # noqa: E402
from miles.trainers import EmbeddedTrainer, TrainerConfig  # noqa: E402
from miles.trainers.draft import DraftLearner  # noqa: E402
from miles.types import GenerateRequest, SamplingParams, Status, Trajectory  # noqa: E402
from miles.utils import gcpolicy  # noqa: E402
from miles.transports.weights import pack_all  # noqa: E402

PRESETS = {
    # CPU: the engine benchmark's small model.
    "small": dict(num_hidden_layers=4, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=288, max_position_embeddings=4096),
    # GPU: Qwen3-0.6B's shape (untied: a tied head would make every token predict itself).
    "0.5b": dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
                 max_position_embeddings=40960),
}
GOAL_KEEP = 0.9  # online acceptance length after the policy moved, as a fraction of its start
GOAL_SPEEDUP = 1.5  # GPU: rollout tokens/s vs no speculation where decode is memory-bound


# ---- the synthetic world --------------------------------------------------------------


def synthetic_policy(cfg: ModelConfig, *, active: int, sharpness: float, seed: int) -> CausalLM:
    g = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg)
    H = cfg.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.1 / H**0.5, generator=g)  # small layers: embeddings dominate
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0, generator=g)
        emb[:, 0] = 3.0  # a constant channel...
        head = model.lm_head.weight
        head.zero_()
        head[:active].normal_(0.0, sharpness / H**0.5, generator=g)
        head[:active, 0] = 25.0 / 3.0  # ...that lifts the active ids' logits by ~25
    return model.eval()


def make_prompts(n: int, active: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, active, (n, length), generator=g).tolist()


def target_set(active: int, seed: int) -> set[int]:
    g = torch.Generator().manual_seed(seed + 17)
    return set(torch.randperm(active, generator=g)[: active // 4].tolist())


# ---- engines --------------------------------------------------------------------------


def engine_config(args, slots: int) -> EngineConfig:
    return EngineConfig(max_batch_size=slots, max_seq_len=args.prompt_len + args.new_tokens + 8, device=args.device,
                        dtype=args.dtype, max_prefill_tokens=max(8192, slots * args.prompt_len))


def spec_config(args, adaptive: bool) -> SpeculativeConfig:
    return SpeculativeConfig(speculative_algorithm=args.algorithm, speculative_num_steps=args.k,
                             speculative_adaptive=adaptive)


def build_engine(args, policy: CausalLM, draft, slots: int, *, adaptive: bool = False, version: int = 0) -> EmbeddedEngine:
    spec = spec_config(args, adaptive) if draft is not None else None
    return EmbeddedEngine(copy.deepcopy(policy), config=engine_config(args, slots), version=version,
                          draft=copy.deepcopy(draft) if draft is not None else None, speculative=spec)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


async def rollout(engine: EmbeddedEngine, prompts: list[list[int]], seeds: list[int], args,
                  tag: str) -> tuple[list, float]:
    sp = [SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=s, ignore_eos=True) for s in seeds]
    _sync(args.device)
    t = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(GenerateRequest(rid=f"{tag}-{i}", input_ids=p, sampling=s))
                                  for i, (p, s) in enumerate(zip(prompts, sp))))
    _sync(args.device)
    elapsed = time.perf_counter() - t
    bad = [o.error or o.finish_reason for o in outs if len(o.output_ids) != args.new_tokens]
    assert not bad, bad[:3]
    return outs, elapsed


def trajectories(prompts, outs, group: int, targets: set[int], step: int) -> list[list[Trajectory]]:
    trajs = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        t = Trajectory(id=f"s{step}-{i}", prompt_id=f"s{step}-{i // group}", group_id=f"s{step}-{i // group}",
                       index_in_group=i % group, prompt_tokens=list(p), status=Status.TRUNCATED)
        t.append(o.output_ids, o.logprobs, o.versions)
        t.reward = sum(tok in targets for tok in o.output_ids) / len(o.output_ids)
        trajs.append(t)
    return [trajs[i : i + group] for i in range(0, len(trajs), group)]


@torch.no_grad()
def drift(start: CausalLM, prompts: list[list[int]], outs: list, device: str) -> dict[str, float]:
    """Entropy estimate of the current policy (mean -log p of its samples) and KL(π_v ‖ π_0)
    estimated on the same samples: how far RL has moved the policy."""
    ids = torch.tensor([p + o.output_ids for p, o in zip(prompts, outs)], device=device)
    P = len(prompts[0])
    lp0 = []
    for chunk in ids.split(8):  # [8, S, V] logits at a time (a 151k vocabulary is large)
        logits = start(chunk).logits[:, P - 1 : -1]
        lp0.append(torch.log_softmax(logits, -1).gather(-1, chunk[:, P:, None])[..., 0].cpu())
    lp0 = torch.cat(lp0)
    lp = torch.tensor([o.logprobs for o in outs])
    return {"entropy": float(-lp.mean()), "kl_from_start": float((lp - lp0).mean())}


class _DraftSink:
    """The online engine's end of the draft channel (what a RolloutWorker does)."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine

    async def receive_draft_weights(self, version: int, buckets: list) -> int:
        return await apply_draft_buckets(self.engine, version, buckets)


# ---- phases ---------------------------------------------------------------------------


async def distill(args, policy: CausalLM, draft, targets: set[int]) -> tuple[object, dict]:
    """D0: the draft trained on the initial policy's samples (what one starts RL with)."""
    engine = build_engine(args, policy, None, args.slots)
    learner = DraftLearner(draft, policy=copy.deepcopy(policy) if args.algorithm == "eagle" else None,
                           lr=args.draft_lr, micro_batch_size=args.draft_micro_batch, device=args.device)
    t0 = time.perf_counter()
    for r in range(args.distill_rounds):
        prompts = make_prompts(args.rollout_batch, args.active_vocab, args.prompt_len, seed=10_000 + r)
        outs, _ = await rollout(engine, prompts, [10_000 * (r + 1) + i for i in range(len(prompts))], args, f"d{r}")
        groups = trajectories(prompts, outs, args.group, targets, -1 - r)
        for _ in range(args.draft_passes):
            metrics = learner.train_on([t for g in groups for t in g])
    await engine.close()
    return learner.draft.eval(), {**metrics, "distill_s": time.perf_counter() - t0}


async def rl_run(args, policy: CausalLM, d0, targets: set[int]) -> tuple[list[dict], CausalLM, object]:
    plain = build_engine(args, policy, None, args.slots)
    frozen = build_engine(args, policy, d0, args.slots, adaptive=False)
    online = build_engine(args, policy, d0, args.slots, adaptive=False)
    trainer = EmbeddedTrainer(copy.deepcopy(policy), config=TrainerConfig(lr=args.lr, device=args.device,
                                                                          micro_batch_size=args.group * 4),
                              algo=AlgorithmConfig(advantage_estimator="grpo", entropy_coef=args.entropy_coef))
    policy_channel, draft_channel = WeightBroadcaster(), WeightBroadcaster(method="receive_draft_weights")
    draft_channel.register("online", _DraftSink(online))
    learner = DraftLearner(copy.deepcopy(d0), policy=copy.deepcopy(policy) if args.algorithm == "eagle" else None,
                           lr=args.draft_lr, micro_batch_size=args.draft_micro_batch, device=args.device)
    drafter = DraftTrainer(learner, draft_broadcaster=draft_channel, policy_broadcaster=policy_channel,
                           train_interval=1)
    sides = {"plain": plain, "frozen": frozen, "online": online}
    start = copy.deepcopy(policy).to(args.device)  # for the drift: KL(π_v ‖ π_0) on π_v's samples
    rows = []
    for step in range(args.steps + 1):
        version = trainer.version
        prompts = make_prompts(args.rollout_batch // args.group, args.active_vocab, args.prompt_len, seed=step)
        prompts = [p for p in prompts for _ in range(args.group)]
        seeds = [step * 100_000 + i for i in range(len(prompts))]
        times, outs = {}, {}
        for name in (["plain", "frozen", "online"] if step % 2 == 0 else ["online", "frozen", "plain"]):
            outs[name], times[name] = await rollout(sides[name], prompts, seeds, args, f"{name}{step}")
        groups = trajectories(prompts, outs["online"], args.group, targets, step)
        tokens = len(prompts) * args.new_tokens
        row = {"step": step, "version": version, "reward": sum(t.reward for g in groups for t in g) / len(prompts),
               "draft_version": online.draft_version, **drift(start, prompts, outs["online"], args.device)}
        for name in sides:
            row[f"{name}_tps"] = tokens / times[name]
        if step == args.steps:
            rows.append(row)
            break
        t0 = time.perf_counter()
        # One policy step and one draft pass, concurrently (separate actors in a real run).
        for _ in range(args.draft_passes):
            await drafter.add_batch(groups)
        metrics, dmetrics = await asyncio.gather(asyncio.to_thread(trainer.train_step, groups),
                                                 drafter.train_pending())
        named = [kv for bucket in trainer.export_weights(1 << 30) for kv in bucket]
        for engine in sides.values():
            await engine.update_weights(named, version=trainer.version)
        if learner.policy is not None:  # the DraftTrainer's policy copy pulls from here
            await policy_channel.publish(trainer.version, pack_all(named, version=trainer.version,
                                                                   bucket_bytes=1 << 30))
        while draft_channel.applied.get("online", -1) < learner.version:
            await asyncio.sleep(0.001)
        row.update({"train_s": time.perf_counter() - t0, "draft_loss": dmetrics.get("draft/loss", float("nan")),
                    "draft_accept_est": dmetrics.get("draft/accept_est", float("nan")),
                    "kl_step": metrics.get("train/mismatch_kl_k1", float("nan"))})
        rows.append(row)
        print(f"step {step}: reward {row['reward']:.3f}  tok/s plain {row['plain_tps']:.0f} frozen "
              f"{row['frozen_tps']:.0f} online {row['online_tps']:.0f}", flush=True)
    per_version = {name: sides[name].spec_stats() for name in ("frozen", "online")}
    for row in rows:
        for name, stats in per_version.items():
            s = stats.get(row["version"], {})
            row[f"{name}_accept_len"] = s.get("spec/accept_len", float("nan"))
            row[f"{name}_accept_rate"] = s.get("spec/accept_rate", float("nan"))
    for engine in sides.values():
        await engine.close()
    return rows, trainer.model.eval(), learner.draft.eval()


PHASES = ("prefill", "plain", "round", "flush", "capture")  # EngineStats.phase_s


def _compiles() -> int:
    """Graphs dynamo compiled, plus variants of the Triton decode attention built, so far in
    this process (a compile inside a timed run is a cost no option's rate shows)."""
    from torch._dynamo.utils import counters

    from miles.kernels import decode_attention as da

    n = int(counters["stats"]["unique_graphs"])
    for fn in (getattr(da, "_partial", None), getattr(da, "_merge", None)):
        for cache in getattr(fn, "device_caches", {}).values():  # triton 3: (kernels, ...) per device
            n += len(cache[0]) if isinstance(cache, tuple) else 0
    return n


async def sweep(args, policy: CausalLM, draft, state: str) -> list[dict]:
    """Rollout tokens/s at each batch size: plain vs spec (adaptive rule) vs spec (always)."""
    out = []
    for batch in args.batches:
        prompts = make_prompts(batch, args.active_vocab, args.prompt_len, seed=99)
        seeds = list(range(batch))
        engines = {"plain": build_engine(args, policy, None, batch),
                   "auto": build_engine(args, policy, draft, batch, adaptive=True),
                   "always": build_engine(args, policy, draft, batch, adaptive=False)}
        best = {name: float("inf") for name in engines}
        captured = {name: [0, 0.0] for name in engines}  # CUDA graphs captured inside timed runs
        # where the adaptive engine's timed runs went (engine phases, dynamo compiles)
        phases = dict.fromkeys(("wall", *PHASES, "compiles"), 0.0)
        # the first runs warm up: graphs, and the adaptive rule's measurements of every option
        # (its choices differ from run to run, so one warm-up left shapes to capture)
        warm = args.warmup_runs
        rule = engines["auto"].spec.controller
        if torch.device(args.device).type == "cuda":
            # One more untimed run of the adaptive engine, with speculation forced on: it
            # captures the round graphs of every batch bucket the run passes through (all k at
            # once), as a long rollout has by the time it is measured. Without it the timed run
            # paid the captures of buckets its warm-up had decoded plainly (H200, 15:37 of
            # 2026-11-30: 16 captures, 1.86 s of a 2.5 s run at batch 64).
            rule.adaptive = False
            await rollout(engines["auto"], prompts, seeds, args, "auto-capture")
            rule.adaptive = True
        for rep in range(warm + args.repeats):
            if rep == warm:
                chosen_before = dict(rule.chosen)  # the rule's choices in the timed runs alone
            for name, engine in engines.items():
                before = dict(GRAPH_CAPTURES)
                st0, compiles0 = engine.stats(), _compiles()
                _, t = await rollout(engine, prompts, seeds, args, f"{name}{rep}")
                if rep >= warm and name == "auto":
                    st1 = engine.stats()
                    phases["wall"] += t
                    phases["compiles"] += _compiles() - compiles0
                    for p in PHASES:
                        phases[p] += st1[f"engine/{p}_s"] - st0[f"engine/{p}_s"]
                if rep >= warm:
                    best[name] = min(best[name], t)
                    captured[name][0] += GRAPH_CAPTURES["count"] - before["count"]
                    captured[name][1] += GRAPH_CAPTURES["seconds"] - before["seconds"]
        stats = {name: e.stats() for name, e in engines.items() if name != "plain"}
        timed = {k: n - chosen_before.get(k, 0) for k, n in sorted(rule.chosen.items()) if n > chosen_before.get(k, 0)}
        b = bucket(batch)
        rates = {o: rule.rate(b, o) for o in rule.options()}
        tokens = batch * args.new_tokens
        out.append({"state": state, "batch": batch, **{f"{n}_tps": tokens / t for n, t in best.items()},
                    "always_accept_len": stats["always"]["spec/accept_len_total"],
                    # the share of the timed runs' steps that were rounds (the warm-ups left out)
                    "auto_spec_frac": sum(n for k, n in timed.items() if k) / max(sum(timed.values()), 1),
                    # what the adaptive rule's wall time holds besides its measured options
                    "auto_k_mean": stats["auto"].get("spec/k_mean", 0.0),
                    "auto_probes": stats["auto"].get("spec/probes", 0.0),
                    "auto_trials": stats["auto"].get("spec/trials", 0.0),
                    "auto_flushes": stats["auto"].get("spec/backlog_flushes", 0.0),
                    # why it chose what it did: its steps per option in the timed runs, and its
                    # measured tokens/s per row of each option at this batch (0 = plain)
                    "auto_timed_choices": " ".join(f"{k}:{n}" for k, n in timed.items()),
                    "auto_rates": " ".join(f"{o}:{r:.0f}" for o, r in rates.items()),
                    # what the rates rest on: median step ms per option, expected tokens per row
                    # per k; and the always-on engine's own round time, for comparison
                    "auto_step_ms": " ".join(f"{o}:{1e3 * rule.step_seconds(b, o):.2f}" for o in rule.options()),
                    "auto_yield": " ".join(f"{k}:{stats['auto'].get(f'spec/expected_tokens_k{k}', 0.0):.2f}"
                                           for k in rule.options() if k),
                    "always_round_ms": 1e3 * engines["always"].spec.controller.step_seconds(b, args.k),
                    **{f"{n}_captures": f"{c[0]} ({c[1]:.2f} s)" for n, c in captured.items()},
                    "auto_phases": " ".join(f"{p} {v:.3f}" if p != "compiles" else f"{p} {v:.0f}"
                                            for p, v in phases.items()),
                    # rounds that replayed a CUDA graph (the rest ran eagerly), per engine
                    **{f"{n}_graph_rounds": f"{st.get('spec/graph_rounds', 0):.0f}/{st.get('engine/spec_rounds', 0):.0f}"
                       for n, st in stats.items()}})
        for engine in engines.values():
            await engine.close()
        del engines
        gc.collect()  # free each batch size's engines (caches, CUDA graph pools) before the next
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"{state}, batch {batch}: plain {out[-1]['plain_tps']:.0f} auto {out[-1]['auto_tps']:.0f} "
              f"always {out[-1]['always_tps']:.0f} tok/s (auto speculated in {100 * out[-1]['auto_spec_frac']:.0f}% "
              f"of steps, mean k {out[-1]['auto_k_mean']:.2f}, {out[-1]['auto_probes']:.0f} probes, "
              f"{out[-1]['auto_trials']:.0f} trials, "
              f"{out[-1]['auto_flushes']:.0f} backlog feeds; timed steps by k {out[-1]['auto_timed_choices']}; "
              f"measured tok/s per row by k {out[-1]['auto_rates']} (step ms {out[-1]['auto_step_ms']}; "
              f"expected tokens per row {out[-1]['auto_yield']}; always-on round {out[-1]['always_round_ms']:.2f} ms); "
              f"graph rounds auto {out[-1]['auto_graph_rounds']}, always {out[-1]['always_graph_rounds']}; "
              f"graphs captured in timed runs: plain {out[-1]['plain_captures']}, auto {out[-1]['auto_captures']}, "
              f"always {out[-1]['always_captures']}; auto timed runs, seconds: {out[-1]['auto_phases']})",
              flush=True)
    return out


# ---- report ---------------------------------------------------------------------------


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    v = [r["version"] for r in rows]
    for name, style in (("online", "o-"), ("frozen", "s--")):
        a.plot(v, [r[f"{name}_accept_len"] for r in rows], style, label=f"{name} draft")
    a.axhline(GOAL_KEEP * rows[0]["online_accept_len"], color="grey", lw=0.8, ls=":", label="90% of start")
    a.set_xlabel("policy version")
    a.set_ylabel("acceptance length (tokens / round)")
    a.legend()
    a.set_title("acceptance length per policy version")
    for name, style in (("online", "o-"), ("frozen", "s--")):
        b.plot(v, [r[f"{name}_tps"] / r["plain_tps"] for r in rows], style, label=f"{name} draft")
    b.axhline(1.0, color="grey", lw=0.8)
    b.set_xlabel("policy version")
    b.set_ylabel("rollout tokens/s ÷ no speculation")
    b.legend()
    b.set_title("rollout throughput")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> str:
    desc = (f"{platform.platform()}, {platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}")
    if torch.cuda.is_available():
        desc += f", {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return desc


def verdicts(args, rows: list[dict], swept: list[dict]) -> list[str]:
    start = rows[0]
    moved = rows[len(rows) // 2 :]  # the second half of the run: the policy has moved
    on = sum(r["online_accept_len"] for r in moved) / len(moved)
    fr = sum(r["frozen_accept_len"] for r in moved) / len(moved)
    keep, frozen_keep = on / start["online_accept_len"], fr / start["frozen_accept_len"]
    out = [f"acceptance length over the second half of the run: online {on:.2f} = {100 * keep:.0f}% of its "
           f"start ({start['online_accept_len']:.2f}), frozen {fr:.2f} = {100 * frozen_keep:.0f}% "
           f"(goal: online ≥ {100 * GOAL_KEEP:.0f}% while frozen falls: "
           f"{'met' if keep >= GOAL_KEEP and frozen_keep < 1.0 else 'NOT met'})"]
    cuda = torch.device(args.device).type == "cuda"
    for r in swept:
        auto, always = r["auto_tps"] / r["plain_tps"], r["always_tps"] / r["plain_tps"]
        goal = f" (goal ≥ {GOAL_SPEEDUP:g}× where memory-bound)" if cuda else ""
        out.append(f"{r['state']}, batch {r['batch']}: spec always {always:.2f}×, adaptive {auto:.2f}× no speculation "
                   f"(adaptive speculated in {100 * r['auto_spec_frac']:.0f}% of steps){goal}")
    return out


def report(args, rows: list[dict], swept: list[dict], d0: dict, png: Path) -> None:
    lines = ["| step | policy version | reward | entropy | KL from v0 | frozen accept len | online accept len | "
             "frozen accept rate | online accept rate | plain tok/s | frozen tok/s | online tok/s | online ÷ plain | "
             "draft loss |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['version']} | {r['reward']:.3f} | {r['entropy']:.2f} | "
                     f"{r['kl_from_start']:.2f} | {r['frozen_accept_len']:.2f} | "
                     f"{r['online_accept_len']:.2f} | {r['frozen_accept_rate']:.2f} | {r['online_accept_rate']:.2f} | "
                     f"{r['plain_tps']:.0f} | {r['frozen_tps']:.0f} | {r['online_tps']:.0f} | "
                     f"{r['online_tps'] / r['plain_tps']:.2f}× | {r.get('draft_loss', float('nan')):.3f} |")
    if swept:
        lines += ["", "Batch-size sweep (start: policy v0 + D0; end: final policy + online draft):", "",
                  "| state | batch | plain tok/s | spec adaptive tok/s | spec always tok/s | adaptive ÷ plain | "
                  "always ÷ plain | accept len (always) | adaptive spec steps |", "|---|---|---|---|---|---|---|---|---|"]
        for r in swept:
            lines.append(f"| {r['state']} | {r['batch']} | {r['plain_tps']:.0f} | {r['auto_tps']:.0f} | {r['always_tps']:.0f} | "
                         f"{r['auto_tps'] / r['plain_tps']:.2f}× | {r['always_tps'] / r['plain_tps']:.2f}× | "
                         f"{r['always_accept_len']:.2f} | {100 * r['auto_spec_frac']:.0f}% |")
    cmd = "python benchmarks/speculative.py " + " ".join(sys.argv[1:])
    desc = (f"preset {args.preset}, {args.algorithm} draft, k = {args.k}, {args.steps} GRPO steps at lr {args.lr:g} "
            f"(batch {args.rollout_batch} = {args.rollout_batch // args.group} prompts × {args.group}, "
            f"{args.slots} engine slots), prompt {args.prompt_len} + {args.new_tokens} new tokens, temperature 1, "
            f"active vocabulary {args.active_vocab}, draft lr {args.draft_lr:g} × {args.draft_passes} passes per "
            f"batch; D0 distilled in {d0['distill_s']:.0f} s (held-in loss {d0.get('draft/loss', float('nan')):.3f}); "
            f"plot: {png.name}")
    text = "\n".join(lines)
    verdict = verdicts(args, rows, swept)
    print(desc, text, *verdict, sep="\n")
    if args.no_record:
        return
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    section = [f"\n## speculative — {stamp}{' (quick)' if args.quick else ''}", "", f"Command: `{cmd}`  ",
               f"Machine: {machine()}  ",
               "The machine was shared with other engineers' jobs; the three engines ran side by side in one "
               "process on the same batches (interleaved order), so the ratios are the figures to read.  ",
               desc, "", text, ""] + [f"- {v}" for v in verdict] + [""]
    with open(args.results, "a", encoding="utf-8") as fh:
        fh.write("\n".join(section))
    print(f"appended to {args.results}")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--algorithm", choices=["draft", "eagle"], default="eagle")
    ap.add_argument("--k", type=int, default=None, help="draft tokens per round")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps")
    ap.add_argument("--lr", type=float, default=None, help="policy learning rate (high: the policy must move)")
    ap.add_argument("--entropy-coef", type=float, default=0.0, help="GRPO entropy bonus (keeps the policy stochastic)")
    ap.add_argument("--draft-lr", type=float, default=None)
    ap.add_argument("--draft-passes", type=int, default=3, help="DraftTrainer passes over each batch")
    ap.add_argument("--draft-micro-batch", type=int, default=None, help="trajectories per draft optimizer step")
    ap.add_argument("--distill-rounds", type=int, default=None)
    ap.add_argument("--rollout-batch", type=int, default=None, help="trajectories per RL step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--slots", type=int, default=None, help="engine slots (concurrent requests) in the RL run")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--active-vocab", type=int, default=None)
    ap.add_argument("--sharpness", type=float, default=None, help="std of the active logits (peakedness)")
    ap.add_argument("--batches", type=int, nargs="*", default=None, help="batch sizes of the tok/s sweep")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup-runs", type=int, default=2, help="untimed runs per engine and batch size first")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "speculative.md"))
    ap.add_argument("--plot", default=None, help="PNG path (default: benchmarks/speculative_<device>.png)")
    args = ap.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    defaults = dict(  # (quick, CPU, CUDA)
        preset=("small", "small", "0.5b"), k=(3, 3, 4), steps=(4, 12, 16), lr=(3e-3, 1e-3, 1e-4),
        draft_micro_batch=(32, 32, 8),
        draft_lr=(3e-3, 3e-3, 1e-3), distill_rounds=(3, 8, 8), rollout_batch=(32, 64, 256),
        slots=(16, 16, 64), new_tokens=(32, 48, 256), active_vocab=(256, 256, 512), sharpness=(8.0, 8.0, 8.0),
        batches=([1, 8], [1, 4, 16], [1, 2, 4, 8, 16, 32, 64]), repeats=(1, 2, 2))
    col = 2 if cuda else (0 if args.quick else 1)
    for name, values in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, values[col])
    args.plot = Path(args.plot or Path(__file__).with_name(f"speculative_{'cuda' if cuda else 'cpu'}.png"))
    if args.rollout_batch % args.group:
        ap.error("--rollout-batch must be a multiple of --group")
    return args


async def amain(args) -> None:
    cfg = tiny_config(**PRESETS[args.preset])
    policy = synthetic_policy(cfg, active=args.active_vocab, sharpness=args.sharpness, seed=0)
    targets = target_set(args.active_vocab, 0)
    draft = build_draft(args.algorithm, cfg, seed=1)
    d0, d0_metrics = await distill(args, policy, draft, targets)
    print(f"D0 distilled: {d0_metrics}", flush=True)
    swept = await sweep(args, policy, d0, "start") if args.batches else []
    rows, final_policy, final_draft = await rl_run(args, policy, d0, targets)
    if args.batches:
        swept += await sweep(args, final_policy, final_draft, "end")
    plot(rows, args.plot, f"{args.preset} policy, {args.algorithm} draft, k={args.k}, {args.device}")
    report(args, rows, swept, d0_metrics, args.plot)


def main() -> None:
    args = parse()
    gcpolicy.install()  # the GC of a rollout worker's process: no full pass in a timed run
    if args.threads:
        torch.set_num_threads(args.threads)
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
