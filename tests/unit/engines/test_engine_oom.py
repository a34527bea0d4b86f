"""Out-of-memory in the engine (miles.engines.oom): an OOM injected into a decode or prefill step
parks the step's rows as aborts with their tokens so far, the batch shrinks, and resuming the
parked rows gives exactly the tokens of an uninterrupted run; one row that does not fit fails
that request and every later one, naming the knobs."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles.types import GenerateRequest, SamplingParams

from .helpers import make_engine, make_model, prompts, run

SP = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)


async def _until_done(engine, rid: str, input_ids: list[int]) -> tuple[list[int], list[float], int]:
    """Generate, resuming after every abort as a worker resumes a PARTIAL trajectory."""
    ids: list[int] = []
    lps: list[float] = []
    parks = 0
    while True:
        out = await engine.generate(GenerateRequest(rid=rid, input_ids=input_ids + ids, sampling=SP,
                                                    num_prefix_tokens=len(ids)))
        ids += out.output_ids
        lps += out.logprobs
        if out.finish_reason != "abort":
            assert out.finish_reason == "length", out.error
            return ids, lps, parks
        parks += 1


@pytest.mark.parametrize("step", [1, 6])  # the first prefill admission; a decode step
def test_injected_oom_parks_rows_and_resumes_to_the_same_tokens(step: int, overlap: bool) -> None:
    model = make_model(seed=2)
    ps = prompts(6, seed=5)

    async def go(inject: list[int]):
        engine = make_engine(model, overlap=overlap, inject_oom_steps=inject)
        outs = await asyncio.gather(*(_until_done(engine, f"r{i}", p) for i, p in enumerate(ps)))
        stats = engine.stats()
        await engine.close()
        return outs, stats

    clean, clean_stats = run(lambda: go([]))
    hit, stats = run(lambda: go([step]))
    assert clean_stats["mem/engine_oom_recovered"] == 0 and clean_stats["engine/batch_limit"] == 8
    assert stats["mem/engine_oom_recovered"] == 1 and stats["engine/oom_fatal"] == 0
    assert stats["engine/batch_limit"] <= 3  # 6 rows ran out: at most 3 at once from then on
    assert sum(parks for _, _, parks in hit) >= 1
    for (ids_a, lps_a, _), (ids_b, lps_b, _) in zip(clean, hit):
        assert ids_a == ids_b  # seeded draws by position: the parked rows resume where they were
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-4


def test_oom_with_one_row_fails_naming_the_knobs() -> None:
    async def go():
        engine = make_engine(inject_oom_steps=[2])
        first = await engine.generate(GenerateRequest(rid="a", input_ids=[5, 6, 7], sampling=SP))
        later = await engine.generate(GenerateRequest(rid="b", input_ids=[5, 6], sampling=SP))
        stats = engine.stats()
        await engine.close()
        return first, later, stats

    first, later, stats = run(go)
    assert first.finish_reason == "error" and "--engine-mem-fraction" in first.error
    assert "--max-batch-size" in first.error and "--rollout-max-response-len" in first.error
    assert later.finish_reason == "error" and later.error == first.error  # the engine serves nothing more
    assert stats["engine/oom_fatal"] == 1 and stats["mem/engine_oom_recovered"] == 0


def test_requests_of_one_event_loop_pass_start_in_one_prefill() -> None:
    """A batch submitted in one pass of the event loop is one prefill even when the loop's thread
    stalls between submissions (a loaded machine): the stepping thread wakes after the pass, so
    an OOM injected into the first step finds all the rows to park, not one row to fail."""
    ps = prompts(4, seed=1)

    async def go():
        engine = make_engine(inject_oom_steps=[1])

        async def submit(i: int, p: list[int]):
            if i:
                time.sleep(0.02)  # the loop's thread holds still; a woken engine would step meanwhile
            return await _until_done(engine, f"r{i}", p)

        outs = await asyncio.gather(*(submit(i, p) for i, p in enumerate(ps)))
        stats = engine.stats()
        await engine.close()
        return outs, stats

    outs, stats = run(go)
    assert stats["mem/engine_oom_recovered"] == 1 and stats["engine/oom_fatal"] == 0
    assert sum(parks for _, _, parks in outs) == len(ps)  # every row of the first prefill was parked
