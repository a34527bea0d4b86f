"""A tool-using agent written with the plain ``openai`` client, trained by miles as it is.

The task: two numbers, a target and a hint word ("add", "subtract", "multiply"); the agent
asks the model for an operator, runs ``a <op> b`` in its Python tool (a subprocess, each
evaluation under a time limit), and tells the model the tool's result until the target is
hit or three tries are used. Reward: 1, 0.5 or 0.25 for a hit on the first, second or third
try, else 0. A uniformly random policy scores about 0.58, one that always adds about 0.8 (most
tasks add), one that follows the hint 1.

``agent(client, sample)`` is an ordinary OpenAI tool loop: it declares the ``python`` tool,
and when the model answers with tool calls (a real chat model does) it runs their code. A
reply without a tool call names the operator: its text when that is ``+``, ``-`` or ``*``;
the tiny byte-level CPU model of ``run.sh`` cannot spell yet, so any other one-token reply
picks by its token id (``id % 3``), a three-way action head over its vocabulary. miles
trains on the session's exact tokens: the model's replies carry loss, the prompt, tool
results and template glue are masked.

    python examples/agent/agent.py prepare OUT     # tiny random checkpoint + prompts
    miles train ... --custom-agent-function-path examples/agent/agent.py:agent   # see run.sh
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

OPS = {"add": "+", "subtract": "-", "multiply": "*"}
MAX_TRIES = 3
# Most tasks add: a policy learns that first (reward ~0.55 -> ~0.8), then the hint words.
WORD_WEIGHTS = (0.6, 0.25, 0.15)
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run a Python expression and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]

_WORKER = r"""
import json, sys
for line in sys.stdin:
    try:
        out = repr(eval(json.loads(line), {"__builtins__": {}}, {}))
    except Exception as exc:
        out = f"error: {type(exc).__name__}: {exc}"
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
"""


class PythonTool:
    """One long-lived Python subprocess per worker (a fresh process per call would cost more
    than the model); each evaluation has a time limit, after which the process is killed
    and the next call starts a new one."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self.proc: asyncio.subprocess.Process | None = None
        self.lock = asyncio.Lock()

    async def run(self, code: str) -> str:
        async with self.lock:
            if self.proc is None or self.proc.returncode is not None:
                self.proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-I", "-c", _WORKER, stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
            proc = self.proc
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write((json.dumps(code) + "\n").encode())
                await proc.stdin.drain()
                line = await asyncio.wait_for(proc.stdout.readline(), self.timeout_s)
                return str(json.loads(line))
            except (asyncio.TimeoutError, ValueError, OSError):
                proc.kill()
                await proc.wait()
                self.proc = None
                return f"error: no result within {self.timeout_s}s"


TOOL = PythonTool()


async def agent(client: Any, sample: Any) -> float:
    task = sample.label
    a, b, target = task["a"], task["b"], task["target"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample.prompt}]
    for attempt in range(MAX_TRIES):
        score = 0.5 ** attempt
        r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=1)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if msg.tool_calls:  # a real model calls the tool itself
            results = []
            for call in msg.tool_calls:
                code = json.loads(call.function.arguments).get("code", "")
                results.append(await TOOL.run(code))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": results[-1]})
            if str(target) in results:
                return score
            continue
        op = (msg.content or "").strip()
        if op not in OPS.values():
            op = "+-*"[r.choices[0].model_extra["token_ids"][0] % 3]
        result = await TOOL.run(f"{a}{op}{b}")
        if result == str(target):
            return score
        messages.append({"role": "tool", "content": f"python: {a}{op}{b} = {result}, not {target}"})
    return 0.0


def prepare(out: str, n: int = 600, seed: int = 0) -> None:
    """A tiny random-init checkpoint and training prompts."""
    from miles.models import CausalLM, build_tiny_tokenizer, save_pretrained, tiny_config

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    save_pretrained(CausalLM(tiny_config()), root / "ckpt", tokenizer=build_tiny_tokenizer())
    rng = random.Random(seed)
    with open(root / "train.jsonl", "w") as f:
        for _ in range(n):
            word = rng.choices(list(OPS), weights=WORD_WEIGHTS)[0]
            a, b = rng.randint(3, 9), rng.randint(3, 9)  # the three results always differ
            target = eval(f"{a}{OPS[word]}{b}")
            f.write(json.dumps({"input": f"{word} {a} and {b} to make {target}. operator?",
                                "label": {"a": a, "b": b, "target": target}}) + "\n")


def report(out_dir: str) -> None:
    """Training reward of the first and last fifth of the steps (from metrics.jsonl)."""
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    k = max(len(rewards) // 5, 1)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(json.dumps({"steps": len(rewards), "reward_first": round(first, 3), "reward_last": round(last, 3)}))


if __name__ == "__main__":
    {"prepare": prepare, "report": report}[sys.argv[1]](*sys.argv[2:])
