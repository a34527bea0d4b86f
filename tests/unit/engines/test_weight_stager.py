"""The engine's staging area: borrowed vs copied tensors, all-or-nothing staging, and
staging that never blocks the stepping thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from miles.engines import WeightError
from miles.engines.weights import WeightStager
from miles.types import GenerateRequest, SamplingParams
from tests.unit.engines.helpers import make_engine, make_model, paced


def _params() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(4, 3), "b": torch.zeros(5), "c": torch.zeros(2, dtype=torch.bfloat16)}


def test_borrow_keeps_matching_tensors_and_copies_the_rest() -> None:
    params = _params()
    stager = WeightStager(params, torch.device("cpu"), torch.float32)
    a, b, c = torch.ones(4, 3), torch.ones(5, dtype=torch.float64), torch.ones(2, dtype=torch.bfloat16)
    assert stager.stage([("a", a), ("b", b), ("c", c)], borrow=True) == 3
    assert stager.staged["a"] is a and stager.staged["c"] is c  # same device and dtype: by reference
    assert stager.staged["b"] is not b and stager.staged["b"].dtype == torch.float32
    stager.stage([("a", torch.full((4, 3), 2.0))])  # without borrow: a copy, replacing the older one
    assert stager.staged["a"] is not a and stager.num_staged == 3
    assert stager.apply() == 3
    assert torch.equal(params["a"], torch.full((4, 3), 2.0)) and torch.equal(params["b"], torch.ones(5))
    assert params["c"].dtype == torch.bfloat16 and stager.num_staged == 0


def test_a_bad_tensor_leaves_the_staging_area_as_it_was() -> None:
    stager = WeightStager(_params(), torch.device("cpu"), torch.float32)
    stager.stage([("b", torch.ones(5))])
    bad = torch.ones(4, 3, dtype=torch.float64)
    bad[1, 2] = float("inf")
    with pytest.raises(WeightError, match="'a' holds non-finite"):  # copied: checked right away
        stager.stage([("b", torch.full((5,), 3.0)), ("a", bad)], borrow=True)
    with pytest.raises(WeightError, match="'b' has shape"):
        stager.stage([("b", torch.ones(6))])
    assert list(stager.staged) == ["b"] and torch.equal(stager.staged["b"], torch.ones(5))


def test_a_borrowed_bad_tensor_is_refused_at_the_commit() -> None:
    params = _params()
    stager = WeightStager(params, torch.device("cpu"), torch.float32)
    bad = torch.ones(4, 3)
    bad[0, 0] = float("nan")
    stager.stage([("b", torch.ones(5)), ("a", bad)], borrow=True)  # borrowed: not read yet
    assert stager.unchecked == {"b", "a"}
    with pytest.raises(WeightError, match="'a' holds non-finite"):
        stager.apply()
    assert torch.equal(params["b"], torch.zeros(5)) and stager.num_staged == 0  # nothing applied
    stager.stage([("a", bad)], borrow=True)
    stager.stage([("a", torch.ones(4, 3))])  # a copy replaces it: checked, no longer pending
    assert stager.unchecked == set() and stager.apply() == 1


def test_staging_runs_while_the_engine_decodes() -> None:
    """A staging call that cannot finish (its tensors are still arriving) does not stop the
    stepping thread: tokens keep coming until the last tensor is in; then the commit swaps."""
    target = make_model(seed=7)
    engine = paced(make_engine(make_model(seed=1)))
    arrived = threading.Event()

    def arriving():
        items = list(target.state_dict().items())
        yield from items[:-1]
        assert arrived.wait(60), "the test never let the last tensor arrive"
        yield items[-1]

    async def scenario() -> int:
        req = GenerateRequest(rid="r", input_ids=[5, 6, 7],
                              sampling=SamplingParams(max_new_tokens=200, ignore_eos=True, temperature=0))
        gen = asyncio.create_task(engine.generate(req))
        staging = asyncio.create_task(asyncio.to_thread(engine.stage_weights, arriving()))
        while engine.progress("r") is None or engine.progress("r") < 2:
            await asyncio.sleep(0.005)
        during = engine.progress("r")
        for _ in range(2000):  # decoding goes on while staging is stuck mid-call
            if engine.progress("r") >= during + 5:
                break
            await asyncio.sleep(0.005)
        moved = engine.progress("r") - during
        arrived.set()
        assert await staging == len(target.state_dict())
        await engine.commit_weights(1)
        out = await gen
        await engine.close()
        assert out.versions[-1] == 1  # the tokens after the swap record the new version
        return moved

    moved = asyncio.run(scenario())
    assert moved >= 5
    stats = engine.stats()
    assert stats["engine/swap_pause_s_max"] > 0 and stats["engine/weight_updates"] == 1
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in engine.model.state_dict().items())
