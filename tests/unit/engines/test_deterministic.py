"""--deterministic: a request's tokens and log-probs are bitwise the same whatever other
requests share its batch or when they arrive (the basis of exact resume on the CPU)."""

from __future__ import annotations

import asyncio

import pytest

from miles.types import GenerateRequest, SamplingParams
from tests.unit.engines.helpers import make_engine, prompts, run

SAMPLING = SamplingParams(max_new_tokens=40, seed=7, ignore_eos=True)


async def _alone(deterministic: bool):
    engine = make_engine(deterministic=deterministic)
    engine.start()
    out = await engine.generate(GenerateRequest(rid="a", input_ids=prompts(1, seed=1)[0], sampling=SAMPLING))
    await engine.close()
    return out


async def _crowded(deterministic: bool):
    engine = make_engine(deterministic=deterministic)
    engine.start()
    others = prompts(6, seed=2, lo=2, hi=30)
    tasks = [asyncio.create_task(engine.generate(GenerateRequest(
        rid=f"o{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=5 + 7 * i, seed=i)))) for i, p in enumerate(others[:3])]
    await asyncio.sleep(0.01)
    target = asyncio.create_task(engine.generate(GenerateRequest(rid="a", input_ids=prompts(1, seed=1)[0], sampling=SAMPLING)))
    await asyncio.sleep(0.005)
    tasks += [asyncio.create_task(engine.generate(GenerateRequest(
        rid=f"p{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=30, seed=10 + i)))) for i, p in enumerate(others[3:])]
    out = await target
    await asyncio.gather(*tasks)
    await engine.close()
    return out


@pytest.mark.parametrize("trial", range(3))
def test_batch_invariant_when_deterministic(trial: int) -> None:
    alone = run(lambda: _alone(True))
    crowded = run(lambda: _crowded(True))
    assert crowded.output_ids == alone.output_ids
    assert crowded.logprobs == alone.logprobs  # bitwise, not approximately
