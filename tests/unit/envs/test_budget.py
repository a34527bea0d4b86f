"""GenerateContext.request_for gives a resumed (or later-turn) request exactly the tokens left.

The engine counts ``max_new_tokens`` from the start of the response, ``num_prefix_tokens``
of which already exist; multi-turn episodes rely on this for every turn after the first.
"""

from __future__ import annotations

import asyncio

import torch

from miles.engines import EmbeddedEngine, EngineConfig
from miles.models import CausalLM, tiny_config
from miles.rollout import generate_single_turn
from miles.types import Status
from tests.unit.engines.helpers import paced
from tests.unit.envs.helpers import TOKENIZER, ScriptedEngine, make_ctx, make_traj


def test_request_budget_counts_the_existing_response_once() -> None:
    ctx = make_ctx(ScriptedEngine(), max_response_len=32)
    t = make_traj()
    t.append(list(range(10, 20)), [0.0] * 10, 0)
    req = ctx.request_for(t)
    assert req.num_prefix_tokens == 10 and req.sampling.max_new_tokens - req.num_prefix_tokens == 22
    req = ctx.request_for(t, max_new_tokens=5)
    assert req.sampling.max_new_tokens - req.num_prefix_tokens == 5
    t.append(list(range(22)), [0.0] * 22, 0)
    assert ctx.request_for(t).sampling.max_new_tokens == ctx.request_for(t).num_prefix_tokens


def test_a_resumed_single_turn_generation_fills_the_response_budget() -> None:
    torch.manual_seed(0)
    engine = paced(EmbeddedEngine(CausalLM(tiny_config(initializer_range=0.1)), config=EngineConfig(max_seq_len=256),
                                  tokenizer=TOKENIZER))
    ctx = make_ctx(engine, max_response_len=120, ignore_eos=True)

    async def interrupted():
        """A trajectory aborted part-way. The engine steps on its own thread (paced to ≥ 1 ms a
        step), so only a host that stalls this thread for ~0.1 s lets a generation finish
        between the progress check and the abort: such a try is not an interruption, and the
        next one is made."""
        for _ in range(20):
            t = make_traj()
            task = asyncio.create_task(generate_single_turn(t, ctx))
            while (engine.progress(t.id) or 0) < 5 and not task.done():
                await asyncio.sleep(0.0005)
            await engine.abort(t.id)
            t = await task
            if t.status is Status.PARTIAL:
                return t
            assert t.status is Status.TRUNCATED and len(t.response_tokens) == 120  # it finished first
        raise AssertionError("no try was interrupted before it finished")

    async def go():
        t = await interrupted()
        assert 0 < len(t.response_tokens) < 120
        t = await generate_single_turn(t, ctx)
        await engine.close()
        return t

    t = asyncio.run(go())
    assert t.status is Status.TRUNCATED and len(t.response_tokens) == 120
