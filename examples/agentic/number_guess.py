"""Number guessing: a multi-turn task where the model must use the environment's feedback.

The environment thinks of a number from 1 to ``high`` (the prompt's label); each model turn
is a guess; the environment answers "higher", "lower" or ends the episode when the guess is
right. With ``--max-turns 3`` and ``high = 7`` a policy that ignores the feedback solves at
most 3/7 ≈ 43% of the games (three distinct guesses); binary search (4, then 2 or 6, then
the last one) solves all of them — so a success rate above 43% means the model uses the
feedback.

Reward: 1 for a solved game, minus 0.1 for each turn whose text is not a number in range
(so only solved games score above 0 and ``eval/pass@1`` is the success rate).

    python examples/agentic/number_guess.py prepare /tmp/guess      # tiny model + data
    miles train --config examples/agentic/number_guess.yaml          # (paths under /tmp/guess)

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


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] != "prepare":
        raise SystemExit("usage: python examples/agentic/number_guess.py prepare OUT_DIR [HIGH]")
    prepare(sys.argv[2], high=int(sys.argv[3]) if len(sys.argv) == 4 else 3)
