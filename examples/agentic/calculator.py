"""A calculator tool for arithmetic word problems: the shape of a real tool-use setup.

The model sees a system prompt describing one tool in the Hermes format Qwen2.5/Qwen3 are
trained on, may call it any number of times with ``<tool_call>{"name": "calculator",
"arguments": {"expression": "..."}}</tool_call>``, gets each result back as a ``tool``
message (the chat template wraps it in ``<tool_response>``), and finally answers in text.
The final answer is scored 1 if its last number equals the label, else 0.

    python examples/agentic/calculator.py prepare /tmp/calc        # train/eval JSONL
    miles train --hf-checkpoint Qwen3-0.6B-local-dir \\
        --prompt-data /tmp/calc/train.jsonl --apply-chat-template \\
        --env-path examples/agentic/calculator.py:CalculatorEnv \\
        --env-observation-role tool --max-turns 6 --max-turn-tokens 512 \\
        --rollout-max-response-len 4096 --partial-rollout --mode async --stale-policy mask ...

Everything a user replaces for their own tools is here: the tool functions, the system
prompt that describes them, and ``score``.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
import sys
from pathlib import Path
from typing import Any

from miles.envs import ToolEnv

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}]

SYSTEM = (
    "You can call functions. The function signatures are inside <tools></tools>:\n<tools>\n"
    + "\n".join(json.dumps(t) for t in TOOLS)
    + "\n</tools>\nTo call one, write <tool_call>{\"name\": <name>, \"arguments\": <args-json>}</tool_call>. "
    "When you know the result, reply with the final number and no tool call."
)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> float | int:
    """Arithmetic only (no names, no calls); exponents are capped so a call stays cheap."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    return ev(ast.parse(expression, mode="eval"))


_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class CalculatorEnv(ToolEnv):
    """``--env-path examples/agentic/calculator.py:CalculatorEnv``."""

    def __init__(self, max_calls_per_turn: int = 4) -> None:
        super().__init__({"calculator": calculator}, max_calls_per_turn=max_calls_per_turn)

    def score(self, answer: str, sample: Any) -> float:
        numbers = _LAST_NUMBER.findall(answer)
        if not numbers:
            return 0.0
        return float(abs(float(numbers[-1]) - float(sample.label)) < 1e-6)


def problems(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(12, 999), rng.randint(12, 999), rng.randint(2, 99)
        question = f"A warehouse has {a} boxes of {c} items each and receives {b} more items. How many items in total?"
        rows.append({"input": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                     "label": a * c + b})
    return rows


def prepare(out: str) -> None:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    for name, n, seed in (("train", 2000, 0), ("eval", 100, 1)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in problems(n, seed)))
    print(f"wrote {root}/train.jsonl and {root}/eval.jsonl")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "prepare":
        raise SystemExit("usage: python examples/agentic/calculator.py prepare OUT_DIR")
    prepare(sys.argv[2])
