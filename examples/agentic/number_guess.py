"""Number guessing: a multi-turn task where the model must use the environment's feedback.

The environment thinks of a number from 1 to ``high`` (the prompt's label, default 3);
each model turn is a guess; the environment answers "higher" or "lower", or ends the
episode when the guess is right. With ``--max-turns 2`` and ``high = 3`` a policy that
ignores the feedback wins at most 2 of 3 games (two different guesses); guessing 2 and
then following the feedback wins them all — so a success rate above 67% means the model
uses the feedback.

Reward: 1 for a won game, minus 0.1 for each turn whose text is not a number in range
(so only won games score above 0 and ``eval/pass@1`` is the success rate).

    python examples/agentic/number_guess.py prepare /tmp/guess     # tiny model + data
    miles train --config examples/agentic/number_guess.yaml ...     # see README.md
    python examples/agentic/number_guess.py analyze /tmp/guess/out # won %, guesses by feedback

Wired in with ``--env-path examples/agentic/number_guess.py:NumberGuessEnv``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

_NUMBER = re.compile(r"\d+")


class NumberGuessEnv:
    def __init__(self, high: int = 3) -> None:
        self.high = high
        self.secret = 0
        self.invalid = 0

    def reset(self, sample: Any) -> str:
        self.secret = int(sample.label)
        return ""  # the data prompt already asks the question

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        match = _NUMBER.search(action)
        guess = int(match.group()) if match else None
        if guess is None or not 1 <= guess <= self.high:
            self.invalid += 1
            return f"say a number from 1 to {self.high}", -0.1, False, {"valid": False}
        if guess == self.secret:
            return "correct", 1.0, True, {"valid": True, "solved": True}
        return ("higher" if guess < self.secret else "lower"), 0.0, False, {"valid": True}


def prepare(out: str, high: int = 3, copies: int = 128) -> None:
    """A tiny random-init checkpoint, training prompts and a held-out evaluation set."""
    from miles.models import CausalLM, build_tiny_tokenizer, save_pretrained, tiny_config

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    save_pretrained(CausalLM(tiny_config()), root / "ckpt", tokenizer=build_tiny_tokenizer())
    question = f"I am thinking of a number from 1 to {high}. Guess it: answer with the number only."

    def rows(n: int) -> str:
        return "".join(json.dumps({"input": [{"role": "user", "content": question}], "label": 1 + i % high}) + "\n"
                       for i in range(n))

    (root / "train.jsonl").write_text(rows(copies * high))
    (root / "eval.jsonl").write_text(rows(high))
    print(f"wrote {root}/ckpt, train.jsonl ({copies * high} games), eval.jsonl ({high} games)")


def analyze(out: str, window: int = 40) -> None:
    """Success rate and guesses per window of train steps, from ``trajectories.jsonl``."""
    from collections import Counter

    from miles.models import load_tokenizer

    rows = [json.loads(line) for line in (Path(out) / "trajectories.jsonl").read_text().splitlines()]
    tok = load_tokenizer(_checkpoint_of(out))
    print(f"{'steps':>9}  {'won':>5}  first guess            after 'higher'         after 'lower'")
    last = max(r["step"] for r in rows)
    for lo in range(0, last, window):
        won, first, after = 0, Counter(), {"higher": Counter(), "lower": Counter()}
        batch = [r for r in rows if lo < r["step"] <= lo + window]
        for r in batch:
            turns, toks = r["metadata"]["env_episode"]["turns"], r["response_tokens"]
            actions = [tok.decode(toks[start:end]).strip() or "?" for start, end, *_ in turns]
            first[actions[0]] += 1
            if len(turns) > 1:
                feedback = tok.decode(toks[turns[0][1]: turns[0][2]])
                for word, counts in after.items():
                    if word in feedback:
                        counts[actions[1]] += 1
            won += r["reward"] > 0

        def top(c: Counter) -> str:
            n = sum(c.values()) or 1
            return " ".join(f"{k}:{v / n:.0%}" for k, v in c.most_common(3)).ljust(22)

        print(f"{lo + 1:>4}-{lo + window:<4}  {won / max(len(batch), 1):>5.0%}  {top(first)} {top(after['higher'])} "
              f"{top(after['lower'])}")


def _checkpoint_of(out: str) -> str:
    import yaml

    return yaml.safe_load((Path(out) / "config.yaml").read_text())["rollout"]["hf_checkpoint"]


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "prepare":
        prepare(sys.argv[2], high=int(sys.argv[3]) if len(sys.argv) == 4 else 3)
    elif len(sys.argv) == 3 and sys.argv[1] == "analyze":
        analyze(sys.argv[2])
    else:
        raise SystemExit("usage: python examples/agentic/number_guess.py prepare OUT_DIR [HIGH] | analyze RUN_DIR")
