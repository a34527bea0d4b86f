"""Test doubles for the env rollout tests: a scripted engine and small environments.

``ScriptedEngine`` answers each generate call with the next scripted turn, cut to the
request's budget as the real engine does; with ``hold=True`` a call waits until ``abort``
or ``release`` so tests can interleave aborts, weight updates and env steps exactly.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

from miles.envs import EnvConfig
from miles.rollout import EnvRollout
from miles.models import CausalLM, build_tiny_tokenizer, tiny_config, token_logprobs
from miles.rollout import GenerateContext
from miles.types import GenerateOutput, GenerateRequest, SamplingParams, Trajectory

TOKENIZER = build_tiny_tokenizer()
EOS = TOKENIZER.eos_token_id


class ScriptedEngine:
    def __init__(self, script: list[list[int]] | None = None, *, version: int = 0, max_seq_len: int = 4096,
                 default: list[int] | None = None, hold: bool = False) -> None:
        self.script = list(script or [])
        self.default = default if default is not None else [40, 41, EOS]
        self.version = version
        self.config = SimpleNamespace(max_seq_len=max_seq_len)
        self.requests: list[GenerateRequest] = []
        self.hold = hold
        self._waiters: dict[str, asyncio.Future[str]] = {}

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.requests.append(request)
        tokens = list(self.script.pop(0) if self.script else self.default)
        budget = request.sampling.max_new_tokens - request.num_prefix_tokens
        finish, stop = "length", None
        for i, tok in enumerate(tokens):
            if tok in request.sampling.stop_token_ids or tok == EOS:
                tokens, finish, stop = tokens[: i + 1], "stop", tok
                break
        if len(tokens) > budget:
            tokens, finish, stop = tokens[:budget], "length", None
        if self.hold:  # wait for abort (keep half the tokens) or release
            fut = asyncio.get_running_loop().create_future()
            self._waiters[request.rid] = fut
            if await fut == "abort":
                tokens, finish, stop = tokens[: max(1, len(tokens) // 2)], "abort", None
        n = len(tokens)
        return GenerateOutput(rid=request.rid, output_ids=tokens, logprobs=[-0.5] * n,
                              versions=[self.version] * n, finish_reason=finish, matched_stop=stop)

    async def abort(self, rid: str | None = None) -> None:
        for key, fut in list(self._waiters.items()):
            if (rid is None or key == rid) and not fut.done():
                fut.set_result("abort")
                del self._waiters[key]

    def release(self) -> None:
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_result("go")
        self._waiters.clear()

    async def until_waiting(self, n: int = 1) -> None:
        while sum(not f.done() for f in self._waiters.values()) < n:
            await asyncio.sleep(0.001)


def make_model(seed: int) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(tiny_config(initializer_range=0.1)).eval()


def check_token_versions(t: Trajectory, models: list[CausalLM], turns: int) -> None:
    """An episode of ``turns`` model turns on the real engine, whose weights moved to version
    i before turn i and to version ``turns`` in the middle of the last one: turn i starts on
    version i; the env tokens between turns carry the version at their append, no loss and no
    log-prob; the last turn switches mid-turn; and each model token's behaviour log-prob is the
    log-prob its version's model (``models[v]``) gives it in the exact context."""
    model = [s for s in t.segments if s.kind == "model"]
    env = [s for s in t.segments if s.kind == "env"]
    assert len(model) == turns and len(env) == turns - 1
    for i, seg in enumerate(model):
        assert t.versions[seg.start] == i
    for i, seg in enumerate(env, start=1):
        assert set(t.versions[seg.start: seg.end]) == {i}
        assert set(t.loss_mask[seg.start: seg.end]) == {0} and set(t.logprobs[seg.start: seg.end]) == {0.0}
    last = t.versions[model[-1].start: model[-1].end]
    assert last[0] == turns - 1 and last[-1] == turns and last == sorted(last)  # switched mid-turn
    assert len(set(t.loss_versions())) == turns + 1
    ids = torch.tensor([t.prompt_tokens + t.response_tokens])
    P = len(t.prompt_tokens)
    with torch.no_grad():
        per_version = [token_logprobs(m(ids).logits[0, P - 1: -1], torch.tensor(t.response_tokens)) for m in models]
    for i, (v, m, lp) in enumerate(zip(t.versions, t.loss_mask, t.logprobs)):
        if m:
            assert abs(per_version[v][i].item() - lp) < 1e-4, (i, v)


def make_ctx(engine: Any, *, max_response_len: int = 512, **sampling: Any) -> GenerateContext:
    return GenerateContext(engine=engine, tokenizer=TOKENIZER, sampling=SamplingParams(**sampling),
                           max_response_len=max_response_len, seed=3)


def make_traj(tid: str = "t0", prompt: str = "play", label: Any = None) -> Trajectory:
    return Trajectory(id=tid, prompt_id="p", group_id="g", prompt_tokens=TOKENIZER.encode(prompt), prompt=prompt,
                      label=label)


def rollout(env_cls: Any, **config: Any) -> EnvRollout:
    return EnvRollout(env_cls, EnvConfig(**config), tokenizer=TOKENIZER)


# ---- environments ---------------------------------------------------------------------------


class CountdownEnv:
    """Ends after ``turns`` steps; observation i is ``obs{i}``, reward i+1 each step."""

    instances: list[CountdownEnv] = []

    def __init__(self, turns: int = 3, first: str = "") -> None:
        self.turns, self.first = turns, first
        self.actions: list[str] = []
        self.closed = False
        CountdownEnv.instances.append(self)

    def reset(self, sample: Trajectory) -> str:
        return self.first

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.actions.append(action)
        i = len(self.actions)
        return f"obs{i}", float(i), i >= self.turns, {"turn": i}

    def close(self) -> None:
        self.closed = True


class AsyncCountdownEnv(CountdownEnv):
    async def reset(self, sample: Trajectory) -> str:  # type: ignore[override]
        await asyncio.sleep(0)
        return self.first

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:  # type: ignore[override]
        await asyncio.sleep(0)
        return super().step(action)


class BrokenEnv:
    """Misbehaves in ``where`` ("init", "reset", "step") in the manner ``how``."""

    def __init__(self, where: str = "step", how: str = "raise", value: Any = None) -> None:
        if where == "init" and how == "raise":
            raise RuntimeError("cannot start the sandbox")
        self.where, self.how, self.value = where, how, value

    def _misbehave(self, normal: Any) -> Any:
        if self.how == "raise":
            raise ValueError("boom")
        if self.how == "hang":
            time.sleep(1)
        if self.how == "garbage":
            return self.value
        return normal

    def reset(self, sample: Trajectory) -> Any:
        return self._misbehave("") if self.where == "reset" else ""

    def step(self, action: str) -> Any:
        return self._misbehave(("ok", 0.0, False, {})) if self.where == "step" else ("ok", 0.0, False, {})


class AsyncHangingEnv:
    def reset(self, sample: Trajectory) -> str:
        return ""

    async def step(self, action: str) -> Any:
        await asyncio.sleep(60)


class BarrierEnv:
    """``step`` blocks until ``parties`` steps run at the same time (proves a thread pool)."""

    barrier: threading.Barrier | None = None

    def reset(self, sample: Trajectory) -> str:
        return ""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        assert BarrierEnv.barrier is not None
        BarrierEnv.barrier.wait(timeout=10)
        return "", 1.0, True, {}
