"""Abort / resume, weight updates mid-generation with per-token versions, pause, staged
commits, stop rules, cancellation, and that decoding leaves the event loop free."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles.engines import EmbeddedEngine, EngineConfig, WeightError
from miles.models import save_pretrained, token_logprobs
from miles.protocols import RolloutEngine
from miles.types import GenerateRequest, SamplingParams

from .helpers import make_engine, make_model, paced, prompts, run

SEEDED = SamplingParams(max_new_tokens=48, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)


async def _wait_progress(engine, rid: str, at_least: int, timeout: float = 60.0) -> int:
    """Wait until ``rid`` has ``at_least`` tokens; fail (never hang) if it finished first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    seen = False
    while (n := engine.progress(rid)) is None or n < at_least:
        seen = seen or n is not None
        if seen and n is None:
            raise AssertionError(f"{rid} finished before reaching {at_least} tokens")
        if loop.time() > deadline:
            raise AssertionError(f"{rid} made no progress to {at_least} tokens in {timeout}s")
        await asyncio.sleep(0.0005)
    return n


def test_engine_satisfies_protocol() -> None:
    assert isinstance(make_engine(), RolloutEngine)


def test_from_pretrained_uses_checkpoint_and_tokenizer(tmp_path, tokenizer) -> None:
    save_pretrained(make_model(seed=9), tmp_path, tokenizer=tokenizer)
    engine = EmbeddedEngine.from_pretrained(tmp_path, config=EngineConfig(max_batch_size=2, max_seq_len=64),
                                            version=3)
    assert engine.version == 3 and engine.tokenizer.eos_token_id == 1

    async def go():
        out = await engine.generate(GenerateRequest(rid="t", input_ids=tokenizer.encode("hi"), sampling=SamplingParams(
            max_new_tokens=20, temperature=0.0, ignore_eos=True, stop=["\x00never"])))
        await engine.close()
        return out

    out = run(go)
    assert len(out.output_ids) == 20 and out.versions == [3] * 20


def test_abort_then_resume_reproduces_uninterrupted_run(overlap: bool) -> None:
    model = make_model(seed=1)
    prompt, other = prompts(2, seed=3)

    async def go():
        engine = paced(make_engine(model, overlap=overlap))
        full = await engine.generate(GenerateRequest(rid="full", input_ids=prompt, sampling=SEEDED))
        # Interrupted run, with another request sharing the batch (composition differs).
        noise = asyncio.create_task(engine.generate(GenerateRequest(
            rid="other", input_ids=other, sampling=SamplingParams(max_new_tokens=80, ignore_eos=True))))
        task = asyncio.create_task(engine.generate(GenerateRequest(rid="a", input_ids=prompt, sampling=SEEDED)))
        await _wait_progress(engine, "a", 10)
        await engine.abort("a")
        part = await task
        rest = await engine.generate(GenerateRequest(
            rid="a2", input_ids=prompt + part.output_ids, sampling=SEEDED,
            num_prefix_tokens=len(part.output_ids)))
        await noise
        await engine.close()
        return full, part, rest

    full, part, rest = run(go)
    assert part.finish_reason == "abort" and 10 <= len(part.output_ids) < 48
    assert len(part.logprobs) == len(part.versions) == len(part.output_ids)
    assert rest.finish_reason == "length"
    assert part.output_ids + rest.output_ids == full.output_ids
    both = part.logprobs + rest.logprobs
    assert max(abs(a - b) for a, b in zip(both, full.logprobs)) < 1e-5


def test_abort_queued_all_and_idempotent() -> None:
    async def go():
        engine = paced(make_engine(max_batch_size=1))
        sp = SamplingParams(max_new_tokens=200, ignore_eos=True)
        tasks = [asyncio.create_task(engine.generate(GenerateRequest(rid=str(i), input_ids=[5, 6], sampling=sp)))
                 for i in range(3)]
        await _wait_progress(engine, "0", 2)
        await engine.abort("2")  # still queued: returns at once with nothing
        queued = await tasks[2]
        await engine.abort("nope")  # unknown ids are ignored
        await engine.abort()
        outs = [await t for t in tasks[:2]]
        stats = engine.stats()
        await engine.close()
        return queued, outs, stats

    queued, outs, stats = run(go)
    assert queued.finish_reason == "abort" and queued.output_ids == []
    assert all(o.finish_reason == "abort" for o in outs)
    assert len(outs[0].output_ids) >= 2
    assert stats["engine/requests_aborted"] == 3


@pytest.mark.parametrize("keep_kv_cache", [False, True])
def test_weight_update_mid_generation_records_versions(keep_kv_cache: bool, overlap: bool) -> None:
    old, new = make_model(seed=1), make_model(seed=2)
    new_weights = {k: v.clone() for k, v in new.state_dict().items()}
    prompt = prompts(1, seed=4)[0]
    sp = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True)

    async def go():
        engine = paced(make_engine(copy.deepcopy(old), overlap=overlap))  # updates its model in place
        task = asyncio.create_task(engine.generate(GenerateRequest(rid="a", input_ids=prompt, sampling=sp)))
        await _wait_progress(engine, "a", 8)
        await engine.pause()
        k = engine.progress("a")
        await asyncio.sleep(0.01)
        assert engine.progress("a") == k  # paused: no decode step ran
        await engine.update_weights(new_weights.items(), version=1, keep_kv_cache=keep_kv_cache)
        assert engine.version == 1
        await engine.resume()
        out = await task
        stats = engine.stats()
        await engine.close()
        return k, out, stats

    k, out, stats = run(go)
    assert out.versions == [0] * k + [1] * (40 - k)
    # the oldest version in the row's cache at each token: a kept cache still holds the
    # old weights' entries; a recomputed one holds only the new weights'
    assert out.kv_versions == ([0] * 40 if keep_kv_cache else [0] * k + [1] * (40 - k))
    assert stats["engine/prefill_tokens_fresh"] == len(prompt)
    recompute = stats["engine/prefill_tokens_recompute"]
    assert recompute == (0 if keep_kv_cache else len(prompt) + k - 1)  # all but its pending token
    assert stats["engine/prefill_tokens"] == len(prompt) + recompute
    ids = torch.tensor([prompt + out.output_ids])
    P = len(prompt)
    with torch.no_grad():
        lp_old = token_logprobs(old(ids).logits[0, P - 1 : -1], torch.tensor(out.output_ids))
        lp_new = token_logprobs(new(ids).logits[0, P - 1 : -1], torch.tensor(out.output_ids))
    got = torch.tensor(out.logprobs)
    assert (got[:k] - lp_old[:k]).abs().max() < 1e-5
    if keep_kv_cache:  # PipelineRL: later tokens attend to K/V the old weights computed
        assert (got[k:] - lp_new[k:]).abs().max() > 1e-4
    else:  # AReaL: the context was recomputed with the new weights
        assert (got[k:] - lp_new[k:]).abs().max() < 1e-5


def test_staged_update_is_all_or_nothing() -> None:
    model, target = make_model(seed=1), make_model(seed=2)
    engine = make_engine(model)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good = list(target.state_dict().items())
    with pytest.raises(WeightError, match=r"'model\.norm\.weight' has shape \(3,\)"):
        engine.stage_weights([good[0], ("model.norm.weight", torch.zeros(3))])
    with pytest.raises(WeightError, match="'model.nope', which is not a parameter"):
        engine.stage_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(WeightError, match="non-finite"):
        engine.stage_weights([("model.norm.weight", torch.full((64,), float("nan")))])
    assert engine.stager.num_staged == 0
    half = len(good) // 2
    assert engine.stage_weights(good[:half]) == half
    assert engine.stage_weights(iter(good[half:])) == len(good) - half
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())  # not yet
    with pytest.raises(ValueError, match="older"):
        run(lambda: _commit(engine, -1))
    run(lambda: _commit(engine, 5))
    assert engine.version == 5
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in engine.model.state_dict().items())


async def _commit(engine, version):
    await engine.commit_weights(version)


def test_stop_rules(tokenizer, overlap: bool) -> None:
    model = make_model(seed=5)
    prompt = tokenizer.encode("abc")

    async def go():
        engine = make_engine(model, tokenizer=tokenizer, max_seq_len=64, overlap=overlap)
        greedy = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
        ref = await engine.generate(GenerateRequest(rid="ref", input_ids=prompt, sampling=greedy))
        stop_tok = ref.output_ids[5]
        first = ref.output_ids.index(stop_tok)
        by_id = await engine.generate(GenerateRequest(rid="id", input_ids=prompt, sampling=SamplingParams(
            max_new_tokens=30, temperature=0.0, stop_token_ids=[stop_tok])))
        text = tokenizer.decode(ref.output_ids[:12])
        stop_str = text[-3:]
        by_str = await engine.generate(GenerateRequest(rid="s", input_ids=prompt, sampling=SamplingParams(
            max_new_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop_str])))
        ctx = await engine.generate(GenerateRequest(rid="c", input_ids=list(range(5, 60)), sampling=SamplingParams(
            max_new_tokens=30, ignore_eos=True)))
        resumed = await engine.generate(GenerateRequest(rid="r", input_ids=prompt + ref.output_ids[:10],
                                                        sampling=greedy, num_prefix_tokens=10))
        done = await engine.generate(GenerateRequest(rid="d", input_ids=prompt, sampling=greedy,
                                                     num_prefix_tokens=30))
        await engine.close()
        return ref, stop_tok, first, by_id, stop_str, by_str, ctx, resumed, done

    ref, stop_tok, first, by_id, stop_str, by_str, ctx, resumed, done = run(go)
    assert ref.finish_reason == "length" and len(ref.output_ids) == 30
    assert by_id.finish_reason == "stop" and by_id.matched_stop == stop_tok
    assert by_id.output_ids == ref.output_ids[: first + 1]
    assert by_str.finish_reason == "stop" and by_str.matched_stop == stop_str
    assert stop_str in tokenizer.decode(by_str.output_ids)
    assert stop_str not in tokenizer.decode(by_str.output_ids[:-1])
    assert ctx.finish_reason == "length" and 55 + len(ctx.output_ids) == 64  # context full
    assert resumed.output_ids == ref.output_ids[10:]  # budget counts the prefix
    assert done.finish_reason == "length" and done.output_ids == []


def test_eos_stops_unless_ignored() -> None:
    model = make_model(seed=6)
    with torch.no_grad():  # make EOS (id 1) the most likely token everywhere
        model.lm_head.weight[1] = model.model.norm.weight * 50

    async def go():
        engine = make_engine(model)
        stop = await engine.generate(GenerateRequest(rid="a", input_ids=[7, 8], sampling=SamplingParams(
            max_new_tokens=10, temperature=0.0)))
        cont = await engine.generate(GenerateRequest(rid="b", input_ids=[7, 8], sampling=SamplingParams(
            max_new_tokens=10, temperature=0.0, ignore_eos=True)))
        await engine.close()
        return stop, cont

    stop, cont = run(go)
    assert stop.output_ids == [1] and stop.finish_reason == "stop" and stop.matched_stop == 1
    assert len(cont.output_ids) == 10 and cont.finish_reason == "length"


def test_cancelled_generate_aborts_its_request() -> None:
    async def go():
        engine = paced(make_engine())
        task = asyncio.create_task(engine.generate(GenerateRequest(
            rid="x", input_ids=[5, 6], sampling=SamplingParams(max_new_tokens=200, ignore_eos=True))))
        await _wait_progress(engine, "x", 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while engine.progress("x") is not None:
            await asyncio.sleep(0.001)
        stats = engine.stats()
        await engine.close()
        return stats

    assert run(go)["engine/requests_aborted"] == 1


def test_event_loop_stays_free_while_decoding() -> None:
    """Another coroutine observes requests mid-flight: generate() does not block the loop."""

    async def go():
        engine = paced(make_engine())
        sp = SamplingParams(max_new_tokens=120, ignore_eos=True)
        seen: list[int] = []

        async def watcher():
            while True:
                n = engine.progress("w0")
                if n is not None and 0 < n < 120:
                    seen.append(n)
                await asyncio.sleep(0)

        watch = asyncio.create_task(watcher())
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(rid=f"w{i}", input_ids=[5, 6, 7], sampling=sp))
                                      for i in range(4)))
        watch.cancel()
        await engine.close()
        return seen, outs

    seen, outs = run(go)
    assert all(len(o.output_ids) == 120 for o in outs)
    assert len(set(seen)) > 1  # the watcher ran at several distinct points of the generation
