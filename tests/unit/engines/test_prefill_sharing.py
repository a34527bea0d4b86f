"""Rows admitted together with the same context (a group's samples of one prompt) prefill
once: the others copy its K/V and sample from its logits, with their own seeds."""

from __future__ import annotations

import asyncio

import pytest

from miles.types import GenerateRequest, SamplingParams

from .helpers import make_engine, make_model, prompts, run


def _generate(engine, reqs: list[GenerateRequest]) -> tuple[list, dict[str, float]]:
    async def go():
        await engine.pause()  # every request queued before the first admission: one prefill
        tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
        while len(engine._waiting) < len(reqs):
            await asyncio.sleep(0.001)
        await engine.resume()
        outs = await asyncio.gather(*tasks)
        stats = engine.stats()
        await engine.close()
        return outs, stats

    return run(go)


@pytest.mark.parametrize("deterministic", [False, True])
def test_same_context_rows_prefill_once_and_sample_as_if_alone(deterministic: bool) -> None:
    a, b = prompts(2, seed=5, lo=6, hi=10)
    group = [("a0", a, 1), ("a1", a, 2), ("a2", a, 3), ("b0", b, 4), ("a3", a, 5)]

    def request(rid: str, ids: list[int], seed: int) -> GenerateRequest:
        return GenerateRequest(rid=rid, input_ids=ids, sampling=SamplingParams(
            max_new_tokens=24, temperature=1.0, seed=seed, ignore_eos=True))

    model = make_model(seed=2)
    together, stats = _generate(make_engine(model, deterministic=deterministic),
                                [request(*g) for g in group])
    assert stats["engine/prefill_tokens"] == len(a) + len(b)
    assert stats["engine/prefill_tokens_shared"] == 3 * len(a)
    assert stats["engine/prefill_tokens_fresh"] == len(a) + len(b)
    # each request alone in an engine of its own: the same tokens (its seed), log-probs to rounding
    for (rid, ids, seed), out in zip(group, together):
        (alone,), solo = _generate(make_engine(model, deterministic=deterministic), [request(rid, ids, seed)])
        assert solo["engine/prefill_tokens_shared"] == 0
        assert out.output_ids == alone.output_ids, rid
        assert out.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # different seeds of one prompt: different samples (the copies did not share a draw)
    assert len({tuple(o.output_ids) for o in together[:3]}) == 3
