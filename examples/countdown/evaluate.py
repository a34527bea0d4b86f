"""Held-out evaluation of a checkpoint, in-process, with the runtime's own rollout engine.

The RL run evaluates during training (``--eval-interval``, written to eval.jsonl); this
script measures a checkpoint on its own — the SFT warm-up before RL, and the policy after
it — with the same engine (``miles.engines.EmbeddedEngine``), sampling settings and reward,
so "before" and "after" are the same measurement. (The run's eval.jsonl cannot give both:
it has no point before the first step, and the eval due at the last step is cancelled when
the run shuts down — see examples/README.md.)

    python examples/countdown/evaluate.py CKPT --data runs/countdown/data/eval.jsonl

CKPT is a Hugging Face directory (config.json + safetensors) or a miles checkpoint written
by ``--save`` (its trainer weights are read with ``miles.checkpoint.load_tree``). It prints
the mean reward, pass@k, and the reward split into short countdowns and the long tail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import types
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # the task files; miles from a plain checkout
from reward import reward  # noqa: E402

LONG = 20  # countdowns of ≥ 20 numbers (≥ 80 tokens) are "the tail"


def load_policy(path: str | Path, base: str | Path | None = None) -> tuple[Any, Any]:
    """(CausalLM, tokenizer) from an HF directory, or from a miles ``--save`` checkpoint
    (whose model config and tokenizer come from ``base``, the run's --hf-checkpoint)."""
    from miles.models import load_pretrained, load_tokenizer

    path = Path(path)
    if (path / "config.json").is_file():
        return load_pretrained(path), load_tokenizer(path)
    from miles.checkpoint import load_tree, resolve_checkpoint
    from miles.models import CausalLM, load_config

    if base is None:
        raise SystemExit(f"{path}: a miles checkpoint; pass --base HF_DIR (the run's --hf-checkpoint)")
    ckpt = resolve_checkpoint(path)
    model = CausalLM(load_config(base))
    model.load_state_dict(load_tree(ckpt, "trainer")["model"])
    return model.eval(), load_tokenizer(base)


async def _sample_all(engine: Any, tokenizer: Any, rows: list[dict], n: int, temperature: float,
                      max_new_tokens: int, seed: int) -> list[list[str]]:
    from miles.types import GenerateRequest, SamplingParams

    async def one(i: int, j: int, text: str) -> str:
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed * 1_000_003 + i * 97 + j)
        out = await engine.generate(GenerateRequest(rid=f"{i}-{j}", input_ids=tokenizer.encode(text), sampling=sp))
        return tokenizer.decode(out.output_ids)

    jobs = [[one(i, j, r["input"]) for j in range(n)] for i, r in enumerate(rows)]
    return [list(await asyncio.gather(*group)) for group in jobs]


def evaluate(model: Any, tokenizer: Any, rows: list[dict], *, n: int = 4, temperature: float = 1.0,
             max_new_tokens: int = 420, seed: int = 0, device: str = "cpu") -> dict[str, float]:
    """Mean reward, pass@k (k = 1, 2, 4, … ≤ n), and the mean reward of short countdowns and of
    the long tail, over ``n`` samples per row (sampled with per-sample seeds: reproducible).
    ``device``: where the engine samples (it takes the model there; a one-off evaluation on
    CUDA runs uncompiled, where a compile would cost more than it saves)."""
    from miles.engines import EmbeddedEngine
    from miles.engines.config import EngineConfig
    from miles.evaluation import pass_at_k

    engine = EmbeddedEngine(model, config=EngineConfig(max_batch_size=64, max_seq_len=512, seed=seed, device=device,
                                                       compile=False), tokenizer=tokenizer)

    async def run() -> list[list[str]]:
        try:
            return await _sample_all(engine, tokenizer, rows, n, temperature, max_new_tokens, seed)
        finally:
            await engine.close()

    responses = asyncio.run(run())
    scores = [[reward(types.SimpleNamespace(response=resp, label=r["label"])) for resp in group]
              for r, group in zip(rows, responses)]
    flat = [s for group in scores for s in group]
    out = {"reward_mean": statistics.fmean(flat)}
    for name, keep in (("short", lambda k: k < LONG), ("long", lambda k: k >= LONG)):
        part = [s for r, g in zip(rows, scores) for s in g if keep(r["metadata"]["numbers"])]
        out[f"reward_{name}"] = statistics.fmean(part) if part else float("nan")
    k = 1
    while k <= n:
        out[f"pass@{k}"] = statistics.fmean(pass_at_k(n, int(sum(g)), k) for g in scores)
        k *= 2
    return out


def read_rows(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description="Evaluate a checkpoint on the held-out countdown prompts.")
    parser.add_argument("checkpoint")
    parser.add_argument("--base", default=None, help="HF directory of the run (for a --save checkpoint)")
    parser.add_argument("--data", default="runs/countdown/data/eval.jsonl")
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=420)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a model this small gains nothing from more, and a shared CPU loses
    model, tokenizer = load_policy(args.checkpoint, args.base)
    rows = read_rows(args.data)[: args.limit]
    metrics = evaluate(model, tokenizer, rows, n=args.n_samples, temperature=args.temperature,
                       max_new_tokens=args.max_new_tokens, seed=args.seed)
    print(" ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
