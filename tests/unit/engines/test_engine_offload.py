"""--offload-rollout in the engine (miles.engines.offload): the KV cache and the weights are
released, the next commit re-allocates them (refilled by the update, or from the pinned host
copy), and the engine then generates exactly what it generated before."""

from __future__ import annotations

import pytest
import torch

from miles.engines import WeightError
from miles.types import GenerateRequest, SamplingParams

from .helpers import make_engine, make_model, prompts, run

SP = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, ignore_eos=True)


def _nbytes(engine) -> tuple[int, int]:
    kv = engine.runner.cache.k.untyped_storage().nbytes()
    w = engine.model.model.embed_tokens.weight.untyped_storage().nbytes()
    return kv, w


@pytest.mark.parametrize("weights", ["discard", "host", "keep"])
def test_offload_releases_and_the_next_commit_restores(weights: str) -> None:
    model = make_model(seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    p = prompts(2, seed=1)

    async def go():
        engine = make_engine(model)
        before = [await engine.generate(GenerateRequest(rid=f"a{i}", input_ids=x, sampling=SP))
                  for i, x in enumerate(p)]
        full = _nbytes(engine)
        released = await engine.offload(weights)
        asleep = _nbytes(engine), engine.stats()
        update = list(state.items()) if weights == "discard" else []  # a LoRA-like update carries no base weight
        await engine.update_weights(update, 1)
        after = [await engine.generate(GenerateRequest(rid=f"b{i}", input_ids=x, sampling=SP))
                 for i, x in enumerate(p)]
        stats = engine.stats()
        await engine.close()
        return before, full, released, asleep, after, stats, _nbytes(engine)

    before, full, released, (asleep, mid), after, stats, restored = run(go)
    assert asleep[0] == 0 and (asleep[1] == 0) == (weights != "keep") and restored == full
    assert released == mid["mem/offload_rollout_bytes"] > full[0] and mid["engine/offloaded"] == 1
    assert stats["engine/offloaded"] == 0 and stats["mem/offload_rollout_s"] > 0
    assert [o.output_ids for o in after] == [o.output_ids for o in before]
    assert [o.versions for o in after] == [[1] * 16] * 2


def test_a_commit_that_does_not_refill_discarded_weights_is_refused() -> None:
    model = make_model(seed=3)
    partial = [(k, v.clone()) for k, v in model.state_dict().items() if "layers.0." in k]

    async def go():
        engine = make_engine(model)
        await engine.generate(GenerateRequest(rid="a", input_ids=[5, 6, 7], sampling=SP))
        await engine.offload("discard")
        with pytest.raises(WeightError, match="does not refill"):
            await engine.update_weights(partial, 1)
        await engine.close()

    run(go)


def test_offloaded_engine_waits_for_the_commit_before_generating() -> None:
    model = make_model(seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    async def go():
        import asyncio

        engine = make_engine(model)
        first = await engine.generate(GenerateRequest(rid="a", input_ids=[5, 6, 7], sampling=SP))
        await engine.offload("discard")
        task = asyncio.create_task(engine.generate(GenerateRequest(rid="b", input_ids=[5, 6, 7], sampling=SP)))
        await asyncio.sleep(0.2)
        waited = not task.done()
        await engine.update_weights(list(state.items()), 1)
        second = await task
        await engine.close()
        return first, waited, second

    first, waited, second = run(go)
    assert waited and second.output_ids == first.output_ids and torch.tensor(second.versions).eq(1).all()
