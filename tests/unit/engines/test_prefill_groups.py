"""Admitted prompts of very different lengths are prefilled in groups, not all padded to the
longest (``miles.utils.cuts``): a resumed partial rollout's long context next to short fresh
prompts. The outputs do not depend on the grouping."""

from __future__ import annotations

import asyncio
import copy

import pytest

import miles.engines.stepper as stepper
from miles.types import GenerateRequest, SamplingParams

from .helpers import make_engine, make_model, prompts, run


def _generate(monkeypatch, cost: float, ps: list[list[int]]) -> tuple[list, list[tuple[int, int]]]:
    monkeypatch.setattr(stepper, "PREFILL_COST", cost)
    engine = make_engine(copy.deepcopy(make_model(seed=3)), max_batch_size=8, max_seq_len=256)
    shapes: list[tuple[int, int]] = []
    prefill = engine.runner.prefill

    def recording(slots, seqs, **kw):
        shapes.append((len(seqs), max(len(s) for s in seqs)))
        return prefill(slots, seqs, **kw)

    engine.runner.prefill = recording

    async def go():
        await engine.pause()  # every request queued before the engine admits any: one admission
        tasks = [asyncio.create_task(engine.generate(GenerateRequest(
            rid=str(i), input_ids=p, sampling=SamplingParams(max_new_tokens=6, seed=i, ignore_eos=True))))
            for i, p in enumerate(ps)]
        while len(engine._waiting) < len(ps):
            await asyncio.sleep(0.001)
        await engine.resume()
        outs = await asyncio.gather(*tasks)
        await engine.close()
        return outs

    return run(go), shapes


@pytest.mark.parametrize("long_first", [True, False])
def test_long_and_short_prompts_prefill_apart_with_the_same_outputs(monkeypatch, long_first: bool) -> None:
    short = prompts(7, seed=5, lo=3, hi=8)
    long = prompts(1, seed=6, lo=200, hi=201)
    ps = long + short if long_first else short + long
    grouped, shapes = _generate(monkeypatch, 8, ps)
    together, one = _generate(monkeypatch, 10**9, ps)
    assert len(one) == 1 and one[0] == (8, 200)  # one prefill padded to the long prompt
    assert (1, 200) in shapes  # the long prompt alone, the short ones apart from it
    assert sum(rows * longest for rows, longest in shapes) < 200 + 7 * 8
    for a, b in zip(grouped, together):
        assert a.output_ids == b.output_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
