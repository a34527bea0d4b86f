"""The countdown task: "count down from 412 to 400:" → " 412 411 410 409 ... 401 400".

Why this task (see examples/README.md): it is verifiable by exact match; a byte-level model
of a few layers learns it in about a minute on a CPU, because every decision is local (copy
the start, take one off the last number, stop at the round hundred); and its response length
is long-tailed by construction — the distance to the hundred, ``m = n mod 100``, is drawn
from a truncated Zipf law, so most answers are a few numbers and a few are a hundred numbers
(400 tokens). The long answers are the ones that hold a synchronous batch back, which is what
asynchronous and partial rollouts fix. The hundreds digit (1-9) only adds variety: 900
distinct prompts, so held-out prompts are new to the model but in the training distribution.

This file is the one definition of the task: prompt and answer formats, the distribution of
starts, the held-out split, and the noisy demonstrations the SFT warm-up learns from. Run it
to write the prompt data (slime's JSONL: ``input``, ``label``, ``metadata``):

    python examples/countdown/task.py --out-dir runs/countdown/data   # train.jsonl, eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

MAX_DISTANCE = 99  # the longest answer: 100 numbers, 400 bytes
ZIPF_S = 1.2  # P(m) ∝ (m + 1)^-s on 0..MAX_DISTANCE
EVAL_SEED = 7  # the held-out starts depend on this seed only, never on the training seed


def distance_weights(s: float = ZIPF_S, max_distance: int = MAX_DISTANCE) -> list[float]:
    return [(m + 1) ** -s for m in range(max_distance + 1)]


def sample_start(rng: random.Random, weights: list[float]) -> int:
    """A start n = 100·h + m: hundreds h uniform in 1..9, distance m from the Zipf law."""
    m = rng.choices(range(len(weights)), weights=weights)[0]
    return 100 * rng.randint(1, 9) + m


def prompt(n: int) -> str:
    return f"count down from {n} to {n // 100 * 100}:"


def answer(n: int) -> str:
    """The reference response (with the leading space the model learns to emit)."""
    return "".join(f" {i}" for i in range(n, n // 100 * 100 - 1, -1))


def noisy_answer(n: int, rng: random.Random, slip_rate: float) -> str:
    """A demonstration with slips: after each number, with ``slip_rate`` the next one is
    skipped or the number repeated (then the countdown goes on from the slip). A model fitted
    to these slips at about that rate per number when it samples, so short countdowns mostly
    succeed and long ones mostly fail — a policy that is partly right, which RL sharpens."""
    out, i, end = [], n, n // 100 * 100
    while i >= end:
        out.append(i)
        i -= rng.choice((0, 2)) if rng.random() < slip_rate else 1
    return "".join(f" {j}" for j in out)


def row(n: int) -> dict:
    return {"input": prompt(n), "label": answer(n).strip(), "metadata": {"start": n, "numbers": n % 100 + 1}}


def held_out(n: int) -> bool:
    """One start per distance is held out, its hundreds digit rotating with the distance
    (100, 205, 310, ...): every distance keeps 8 of its 9 starts for training."""
    m = n % 100
    return n // 100 == 1 + (4 * m) % 9


def eval_starts(count: int) -> list[int]:
    """``count`` distinct held-out starts, drawn (without replacement) with the Zipf weights."""
    rng, weights = random.Random(EVAL_SEED), distance_weights()
    pool = [n for n in range(100, 1000) if held_out(n)]
    chosen: list[int] = []
    while len(chosen) < count and pool:
        n = rng.choices(pool, weights=[weights[p % 100] for p in pool])[0]
        pool.remove(n)
        chosen.append(n)
    return chosen


def train_starts(count: int, seed: int) -> list[int]:
    """``count`` starts from the training distribution (repeats allowed), none held out."""
    rng, weights, starts = random.Random(seed), distance_weights(), []
    while len(starts) < count:
        n = sample_start(rng, weights)
        if not held_out(n):
            starts.append(n)
    return starts


def write_jsonl(path: Path, starts: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for n in starts:
            fh.write(json.dumps(row(n)) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the countdown prompt data.")
    parser.add_argument("--out-dir", default="runs/countdown/data")
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-eval", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out_dir)
    evaluation = eval_starts(args.num_eval)
    write_jsonl(out / "eval.jsonl", evaluation)
    write_jsonl(out / "train.jsonl", train_starts(args.num_train, args.seed))
    lengths = sorted(len(answer(n)) for n in evaluation)
    print(f"wrote {out}/train.jsonl ({args.num_train} prompts) and {out}/eval.jsonl ({args.num_eval} "
          f"held-out prompts; answer length median {lengths[len(lengths) // 2]}, max {lengths[-1]} bytes)")


if __name__ == "__main__":
    main()
