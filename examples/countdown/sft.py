"""SFT warm-up: a small model of miles' architecture learns the countdown task from noisy demos.

RL needs a starting policy that is partly right: one that never succeeds gets no signal, one
that always succeeds has nothing to learn. This script trains a few-layer Qwen3-style
``CausalLM`` (3 layers, hidden 96, byte-level tiny tokenizer; 0.3 M parameters) from scratch
with plain torch — teacher forcing, AdamW, cosine LR, loss on the response tokens only — on
demonstrations that slip now and then (a number skipped or repeated, ``--slip-rate`` per
number; see ``task.noisy_answer``). The result knows the task (greedy decoding solves ~97%
of the held-out prompts) but slips at about that rate when it samples at temperature 1, so
it solves most short countdowns and few long ones: RL starts near reward 0.6 on the
training distribution (0.2 on the tail-heavy held-out set) and has the long tail to fix.
The measured figures are in examples/README.md.

Deterministic (seeded, one thread) and cached: when OUT already holds a checkpoint made
with the same arguments, it is reused (``--force`` retrains). ``--device cuda`` trains a larger
warm start where a GPU makes it cheap (``benchmarks/async_vs_sync.py --workload countdown
--device cuda`` asks for one; the checkpoint is written from the CPU either way).

    python examples/countdown/sft.py --data runs/countdown/data/train.jsonl --out runs/countdown/sft
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # the task files; miles from a plain checkout
import task  # noqa: E402


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from miles.models import CausalLM, tiny_config

    config = tiny_config(
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden_size // 4,
        max_position_embeddings=512,
    )
    torch.manual_seed(args.seed)
    return CausalLM(config)


def demos(rows: list[dict[str, Any]], rng: random.Random, tokenizer: Any,
          slip_rate: float) -> list[tuple[list[int], int]]:
    """One noisy demonstration per row: (prompt + response + eos token ids, prompt length)."""
    out: list[tuple[list[int], int]] = []
    for r in rows:
        p = tokenizer.encode(r["input"])
        resp = tokenizer.encode(task.noisy_answer(r["metadata"]["start"], rng, slip_rate)) + [tokenizer.eos_token_id]
        out.append((p + resp, len(p)))
    return out


def batches(examples: list[tuple[list[int], int]], budget: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped by similar length, each group ≤ ``budget`` padded tokens, shuffled."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        n = len(examples[i][0])
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


def collate(examples: list[tuple[list[int], int]], idx: list[int], pad: int) -> tuple[torch.Tensor, ...]:
    T = max(len(examples[i][0]) for i in idx)
    ids = torch.full((len(idx), T), pad, dtype=torch.long)
    mask = torch.zeros((len(idx), T), dtype=torch.long)
    target_mask = torch.zeros((len(idx), T), dtype=torch.bool)
    for row, i in enumerate(idx):
        seq, plen = examples[i]
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        target_mask[row, plen : len(seq)] = True  # response tokens (and eos) carry the loss
    return ids, mask, target_mask


def train(args: argparse.Namespace) -> None:
    from miles.models import build_tiny_tokenizer, save_pretrained

    tokenizer = build_tiny_tokenizer()
    rows = [json.loads(line) for line in Path(args.data).read_text(encoding="utf-8").splitlines() if line.strip()]
    device = torch.device(args.device)
    model = build_model(args).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    rng = random.Random(args.seed)
    start, step, seen = time.monotonic(), 0, 0
    while step < args.steps:
        examples = demos(rows, rng, tokenizer, args.slip_rate)  # fresh slips every epoch
        for idx in batches(examples, args.batch_tokens, rng):
            if step >= args.steps:
                break
            ids, mask, target_mask = (t.to(device) for t in collate(examples, idx, tokenizer.pad_token_id))
            lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
            for g in opt.param_groups:
                g["lr"] = lr
            logits = model(ids, attention_mask=mask).logits[:, :-1]
            targets = ids[:, 1:]
            keep = target_mask[:, 1:]
            loss = F.cross_entropy(logits[keep], targets[keep])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            seen += len(idx)
            if step % args.log_every == 0 or step == args.steps:
                print(f"sft step {step}/{args.steps} loss {loss.item():.4f} lr {lr:.2e} "
                      f"({seen} demos, {time.monotonic() - start:.0f}s)", flush=True)
    save_pretrained(model.cpu().eval(), args.out, tokenizer=tokenizer)
    print(f"sft: saved {args.out} after {step} steps in {time.monotonic() - start:.0f}s", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="SFT warm-up for the counting example.")
    parser.add_argument("--data", default="runs/countdown/data/train.jsonl")
    parser.add_argument("--out", default="runs/countdown/sft")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per batch")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--slip-rate", type=float, default=0.1, help="slips per number in the demos")
    parser.add_argument("--hidden-size", type=int, default=96)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where to train (cpu, cuda)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for a model this small)")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--force", action="store_true", help="retrain even if OUT holds this checkpoint")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not Path(args.data).is_file():
        raise SystemExit(f"sft: --data {args.data}: file not found (write it with examples/countdown/task.py)")
    out = Path(args.out)
    # the data by content, not by path: a checkpoint copied with its data to another machine is reused
    recipe = {k: v for k, v in vars(args).items() if k not in ("data", "out", "force", "log_every", "threads")}
    recipe["data_sha256"] = hashlib.sha256(Path(args.data).read_bytes()).hexdigest()
    stamp = out / "sft_args.json"
    if not args.force and stamp.is_file() and json.loads(stamp.read_text()) == recipe \
            and (out / "model.safetensors").is_file():
        print(f"sft: reusing {out} (same arguments; --force to retrain)")
        return
    torch.set_num_threads(args.threads)
    train(args)
    stamp.write_text(json.dumps(recipe, indent=1))


if __name__ == "__main__":
    main()
