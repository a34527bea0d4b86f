"""Real model sizes on one GPU: colocated RL steps through the embedded engine and trainer.

One process per shape (random weights), rollout and training taking turns on one device as
``--colocate --mode sync`` does, in-process so that ``torch.cuda.max_memory_allocated`` (reset
before each phase) is the GPU's peak for that phase, engine and trainer together:

1. ``rollout``: ``--prompts`` × ``--samples`` generations of ``--response-len`` tokens;
2. ``offload``: the engine releases its KV cache and weights (``EmbeddedEngine.offload``, what
   ``--offload-rollout`` does; ``--engine-weights``: ``discard`` for full updates, ``host``
   for LoRA, whose updates carry the adapters alone, ``keep`` for the KV cache only);
3. ``train``: one ``EmbeddedTrainer.train_step`` (GRPO), with ``--offload-train`` for a
   full-parameter run (the AdamW moments wait in pinned host memory during rollouts);
4. ``update``: the trainer's weight update staged into the engine and committed once (the
   commit re-allocates what the offload released): its bytes, its seconds, the commit's pause.

The rollout stall is the time from the end of the train step to an engine that can generate
again (export, staging, commit, re-allocation): what a colocated run waits for each step; the
refill is its part spent re-allocating what the offload released (and, for ``host``, copying
the weights back), the commit pause the part a decoding engine would see.

    python benchmarks/memory.py --shape 8b --mode full --json /tmp/8b.json      # H200
    python benchmarks/memory.py --shape 32b --mode lora --json /tmp/32b.json    # H200
    python benchmarks/memory.py --summarize /tmp/8b.json /tmp/32b.json          # the table + log
    python benchmarks/memory.py --shape tiny --device cpu                        # the CPU check

Arithmetic for the 32B LoRA run (bf16): 32.8 B parameters are 65.5 GB a copy. The trainer's
frozen base (bf16, ``miles.trainers.lora.cast_for_training``) is the only copy on the GPU: the
engine serves it as is (``EmbeddedEngine.over_shared_base``, adapters unmerged) and holds only
what the trainer keeps in float32 (embedding, norms: about 1.6 GB in bf16). ``--engine-base own``
measures the older layout: the engine's own copy (131 GB of the H200's 150 GB for the two),
adapters merged into it, ``--engine-weights host`` moving it to pinned host memory while the
trainer runs and back before each commit (the refill).

Trainer and engine run in this one process, so the shared engine uses the trainer's tensors
directly. In a ``miles train --colocate --lora-rank`` run they are separate Ray actors and the
worker's engine maps the same storages through CUDA IPC handles opened once at its start
(``PolicyTrainer.base_offer``, ``miles.engines.shared.open_offer``): the same single copy, which
this benchmark does not go through; ``tests/gpu/test_lora_shared_gpu.py`` (an engine process over
IPC views) and ``tests/gpu/test_runs_gpu.py`` (a colocated LoRA run through the actors) check it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from miles.algorithms import AlgorithmConfig  # noqa: E402
from miles.engines import EmbeddedEngine, EngineConfig  # noqa: E402
from miles.engines.shared import shared_bytes, sharing_problem  # noqa: E402
from miles.models import CausalLM, tiny_config  # noqa: E402
from miles.trainers import EmbeddedTrainer, TrainerConfig  # noqa: E402
from miles.types import GenerateRequest, SamplingParams, Trajectory  # noqa: E402

GB, GiB = 1e9, float(1 << 30)
SHAPES = {
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=288, max_position_embeddings=1024),
    "8b": dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
               max_position_embeddings=40960),
    "32b": dict(num_hidden_layers=64, hidden_size=5120, intermediate_size=25600, num_attention_heads=64,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
                max_position_embeddings=40960),
}
PHASES = ("rollout", "offload", "train", "update")


def build_model(shape: str, device: str, dtype: torch.dtype, seed: int) -> CausalLM:
    """Random weights made on ``device`` in ``dtype`` (no float32 or host copy on the way)."""
    with torch.device("meta"):
        model = CausalLM(tiny_config(**SHAPES[shape]))
    model = model.to(dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        model.reset_parameters(torch.Generator(device=device).manual_seed(seed))
    return model


class Peaks:
    """Peak allocated bytes per phase (CUDA; zeros on the CPU) and the seconds it took."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.rows: list[dict[str, float]] = []

    def start(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return time.perf_counter()

    def stop(self, row: dict[str, float], phase: str, start: float) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        row[f"{phase}_s"] = time.perf_counter() - start
        row[f"{phase}_peak_gib"] = torch.cuda.max_memory_allocated() / GiB if self.cuda else 0.0


async def rollout(engine: EmbeddedEngine, step: int, prompts: int, samples: int, response_len: int,
                  vocab: int) -> list[list[Trajectory]]:
    g = torch.Generator().manual_seed(step)
    groups = []
    tasks = []
    for p in range(prompts):
        prompt = torch.randint(5, vocab, (32,), generator=g).tolist()
        for m in range(samples):
            sp = SamplingParams(max_new_tokens=response_len, temperature=1.0, ignore_eos=True,
                                seed=1000 * step + 10 * p + m)
            tasks.append((p, m, prompt, engine.generate(GenerateRequest(rid=f"s{step}p{p}m{m}", input_ids=prompt,
                                                                        sampling=sp))))
    outs = await asyncio.gather(*(t for *_, t in tasks))
    by_prompt: dict[int, list[Trajectory]] = {}
    for (p, m, prompt, _), out in zip(tasks, outs):
        assert out.finish_reason == "length", out.error
        t = Trajectory(id=f"s{step}p{p}m{m}", prompt_id=f"p{p}", group_id=f"s{step}p{p}", prompt_tokens=prompt)
        t.append(out.output_ids, out.logprobs, out.versions)
        t.reward = sum(tok < vocab // 2 for tok in out.output_ids) / len(out.output_ids)  # any signal will do
        by_prompt.setdefault(p, []).append(t)
    groups = list(by_prompt.values())
    return groups


async def weight_update(engine: EmbeddedEngine, trainer: EmbeddedTrainer, dtype: torch.dtype,
                        bucket_bytes: int) -> tuple[int, int]:
    """Stage every bucket, then commit once (as a rollout worker's inbox does); (bytes, tensors)."""
    shipped = tensors = 0
    for bucket in trainer.export_weights(bucket_bytes, dtype=dtype):
        shipped += sum(t.numel() * t.element_size() for _, t in bucket)
        tensors += len(bucket)
        engine.stage_weights(bucket, borrow=True)
    await engine.commit_weights(trainer.version)
    return shipped, tensors


async def run(args: argparse.Namespace) -> dict:
    device = args.device
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    lora = args.mode == "lora"
    cfg_shape = tiny_config(**SHAPES[args.shape])
    # The trainer: a LoRA run's base in the compute dtype, a full run's weights in float32.
    t0 = time.perf_counter()
    model = build_model(args.shape, device, dtype if lora else torch.float32, seed=0)
    tcfg = TrainerConfig(lr=1e-5, device=device, seed=0, compile=False, gradient_checkpointing=True,
                         micro_batch_size=args.micro_batch, offload_train=args.offload and not lora,
                         lora_rank=args.lora_rank if lora else 0, lora_alpha=2.0 * args.lora_rank)
    trainer = EmbeddedTrainer(model, config=tcfg, algo=AlgorithmConfig())
    ecfg = EngineConfig(device=device, max_batch_size=args.prompts * args.samples,
                        max_seq_len=32 + args.response_len + 8, compile=False, seed=0)
    # The engine: for LoRA, the trainer's frozen base served as is (one copy, adapters unmerged)
    # unless --engine-base own or sharing cannot work; else its own copy, equal to the trainer's.
    base_problem = "--engine-base own" if args.engine_base == "own" else "full-parameter training"
    if lora and args.engine_base != "own":
        base_problem = sharing_problem(cfg_shape, trainer.shared_base(), device, dtype)
    if base_problem is None:
        engine = EmbeddedEngine.over_shared_base(cfg_shape, trainer.shared_base(), config=ecfg)
    else:
        emodel = build_model(args.shape, device, dtype, seed=1)
        with torch.no_grad():
            src = dict(trainer.model.named_parameters())
            for name, p in emodel.named_parameters():
                p.copy_(src[name])
        engine = EmbeddedEngine(emodel, config=ecfg)
    lora_path = "shared" if engine.shared else "merged"
    print(json.dumps({"lora_path": lora_path if lora else None, "why_not_shared": base_problem,
                      "engine_shared_gib": shared_bytes(engine.model, engine.shared) / GiB}), flush=True)
    init_s = time.perf_counter() - t0
    num_params = sum(p.numel() for n, p in trainer.model.named_parameters() if ".lora_" not in n)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    full_update_bytes = num_params * torch.empty((), dtype=dtype).element_size()
    weights_mode = args.engine_weights if args.engine_weights != "auto" else ("host" if lora else "discard")
    peaks = Peaks(device)
    rows = []
    for step in range(args.steps):
        row: dict[str, float] = {"step": step + 1}
        start = step_start = peaks.start()
        groups = await rollout(engine, step, args.prompts, args.samples, args.response_len, cfg_shape.vocab_size)
        peaks.stop(row, "rollout", start)
        start = peaks.start()
        row["offload_bytes"] = await engine.offload(weights_mode) if args.offload else 0
        peaks.stop(row, "offload", start)
        start = peaks.start()
        metrics = trainer.train_step(groups)
        peaks.stop(row, "train", start)
        start, refill = peaks.start(), engine.offloader.seconds
        row["update_bytes"], row["update_tensors"] = await weight_update(engine, trainer, dtype, args.bucket_bytes)
        peaks.stop(row, "update", start)
        row["stall_s"] = row["update_s"]  # train done -> the engine can generate again
        row["refill_s"] = engine.offloader.seconds - refill  # of which: re-allocating what the offload released
        row["swap_pause_s"] = engine.stats().get("engine/swap_pause_s", 0.0)
        row["step_s"] = time.perf_counter() - step_start
        row["train_tokens"] = metrics["train/tokens"]
        row["offload_train_s"] = metrics.get("mem/offload_train_s", 0.0)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    stats = engine.stats()
    await engine.close()
    return {
        "shape": args.shape, "mode": args.mode, "device": device, "params": num_params, "trainable": trainable,
        "lora_rank": args.lora_rank if lora else 0, "engine_weights": weights_mode if args.offload else "resident",
        "lora_path": lora_path if lora else "", "why_not_shared": base_problem,
        "engine_shared_bytes": shared_bytes(engine.model, engine.shared),
        "lora_shared_base": stats["engine/lora_shared_base"],
        "offload_train": tcfg.offload_train, "init_s": init_s, "full_update_bytes": full_update_bytes,
        "offload_rollout_s": stats["mem/offload_rollout_s"], "oom_recovered": stats["mem/engine_oom_recovered"],
        "steps": rows, "gpu_total_gib": torch.cuda.get_device_properties(0).total_memory / GiB if cuda else 0.0,
    }


def table(results: list[dict]) -> list[str]:
    """The compact table: per shape, the worst step's peaks per phase, the mean step time,
    update bytes (and against a full update of that shape) and the rollout stall."""
    head = ("| shape | mode | engine weights | steps | peak GiB rollout / offload / train / update | step s "
            "| update bytes | vs full update | stall s (refill s) | commit pause s | offload s (rollout, train) |")
    lines = [head, "|" + "---|" * 11]
    for r in results:
        steps = r["steps"][1:] or r["steps"]  # the first step pays one-off costs (pinned buffers, graphs)
        peak = " / ".join(f"{max(s[f'{p}_peak_gib'] for s in r['steps']):.1f}" for p in PHASES)
        mean = lambda k: sum(s[k] for s in steps) / len(steps)  # noqa: E731
        upd = mean("update_bytes")
        mode = f"{r['mode']} r={r['lora_rank']}" if r["lora_rank"] else r["mode"]
        if r.get("lora_path"):  # shared: the engine serves the trainer's base, adapters unmerged
            mode += f" {r['lora_path']}"
        lines.append(
            f"| {r['shape']} | {mode} | {r['engine_weights']} "
            f"| {len(r['steps'])} | {peak} | {mean('step_s'):.2f} | {upd / 1e6:.1f} MB | {upd / r['full_update_bytes']:.2%} "
            f"| {mean('stall_s'):.2f} ({mean('refill_s'):.2f}) | {mean('swap_pause_s'):.3f} | {r['offload_rollout_s']:.1f}, "
            f"{r['steps'][-1]['offload_train_s']:.1f} |")
    lora = [r for r in results if r["mode"] == "lora"]
    full = [r for r in results if r["mode"] == "full"]
    for r in lora:
        steps = r["steps"][1:] or r["steps"]
        upd = sum(s["update_bytes"] for s in steps) / len(steps)
        verdict = "met" if upd <= 0.01 * r["full_update_bytes"] else "missed"
        lines.append(f"\nLoRA update {upd / 1e6:.1f} MB = {upd / r['full_update_bytes']:.3%} of a full {r['shape']} "
                     f"update ({r['full_update_bytes'] / 1e6:.1f} MB): goal <= 1% {verdict}")
    for r in results:
        lines.append(f"{r['shape']}: {r['params'] / 1e9:.2f} B parameters ({r['full_update_bytes'] / GB:.1f} GB a copy in "
                     f"the engine dtype), {r['trainable'] / 1e6:.1f} M trainable; set-up {r['init_s']:.0f} s")
    for r in lora:
        if r.get("lora_path") == "shared":
            lines.append(f"{r['shape']} lora: the engine serves {r['engine_shared_bytes'] / GiB:.1f} GiB of the "
                         f"trainer's frozen base as is (one copy on the GPU), adapters unmerged")
        elif r.get("lora_path"):
            lines.append(f"{r['shape']} lora: the engine holds its own base copy, adapters merged "
                         f"({r.get('why_not_shared')})")
    for r in full:
        lines.append(f"Full update measured ({r['shape']}): {r['steps'][-1]['update_bytes'] / 1e6:.1f} MB "
                     f"in {r['steps'][-1]['update_s']:.2f} s")
    return lines


def summarize(paths: list[str], log: str) -> None:
    from benchmarks.trainer import record_section

    results = [json.loads(Path(p).read_text()) for p in paths if Path(p).is_file()]
    missing = [p for p in paths if not Path(p).is_file()]
    lines = table(results) + [f"(no result: {p})" for p in missing]
    cuda = any(r["device"].startswith("cuda") for r in results)
    machine = torch.cuda.get_device_name(0) if cuda and torch.cuda.is_available() else "CPU"
    total = max((r["gpu_total_gib"] for r in results), default=0.0)
    setup = (f"GPU memory {total:.0f} GiB; torch {torch.__version__}; in-process engine + trainer, random weights; "
             "peaks are torch.cuda.max_memory_allocated reset per phase")
    raw = ["", "<details><summary>raw</summary>", "", "```json", json.dumps(results, indent=1), "```",
           "", "</details>"]
    record_section("memory", machine, setup, lines + raw, log, save=bool(log))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--mode", choices=["full", "lora"], default="full")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--bucket-bytes", type=int, default=1 << 30)
    ap.add_argument("--no-offload", dest="offload", action="store_false",
                    help="keep the engine resident while training (and the AdamW moments on the GPU)")
    ap.add_argument("--engine-weights", choices=["auto", "discard", "host", "keep"], default="auto")
    ap.add_argument("--engine-base", choices=["auto", "own"], default="auto",
                    help="LoRA: auto serves the trainer's frozen base shared where it can (one copy, "
                         "adapters unmerged); own gives the engine its own copy (adapters merged)")
    ap.add_argument("--json", default=None, help="write this shape's result here (for --summarize)")
    ap.add_argument("--summarize", nargs="+", default=None, help="result files: print the table, append the log")
    ap.add_argument("--log", default="benchmarks/log/memory.md", help="'' to print only")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize, args.log)
        return
    result = asyncio.run(run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    print("\n".join(table([result])), flush=True)


if __name__ == "__main__":
    main()
