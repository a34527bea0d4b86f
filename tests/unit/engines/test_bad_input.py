"""Bad input fails that request only, with a clear error; the engine keeps serving."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.engines import EngineConfig
from miles.models import token_logprobs
from miles.types import GenerateRequest, SamplingParams

from .helpers import make_engine, make_model, paced, run

OK = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)


def _gen(engine, rid, ids, sp=OK, **kw):
    return engine.generate(GenerateRequest(rid=rid, input_ids=ids, sampling=sp, **kw))


def test_bad_requests_error_while_others_are_served() -> None:
    async def go():
        # paced: g0's 16 steps take >= 32 ms, so the duplicate below surely finds it in flight
        # (with the CPU decode kernel they took ~2 ms, and on a loaded machine the duplicate,
        # one event-loop turn later, sometimes found g0 done)
        engine = paced(make_engine(max_seq_len=32), 0.002)
        good = [asyncio.create_task(_gen(engine, f"g{i}", [5 + i, 6, 7])) for i in range(3)]
        await asyncio.sleep(0)  # the good requests are queued (generate registers before its first await)
        dup_task = asyncio.create_task(_gen(engine, "g0", [5]))  # a second request with g0's id
        await asyncio.sleep(0)
        bad = await asyncio.gather(
            _gen(engine, "long", list(range(5, 37))),
            _gen(engine, "oov", [5, 288, 6]),
            _gen(engine, "neg", [-1]),
            _gen(engine, "empty", []),
            _gen(engine, "temp", [5], SamplingParams(temperature=-1.0)),
            _gen(engine, "topp", [5], SamplingParams(top_p=0.0)),
            _gen(engine, "topk", [5], SamplingParams(top_k=0)),
            _gen(engine, "stopstr", [5], SamplingParams(stop=["x"])),
            _gen(engine, "prefix", [5], num_prefix_tokens=-2),
        )
        outs = await asyncio.gather(*good)
        dup = await dup_task
        await engine.close()
        return bad, outs, dup

    bad, outs, dup = run(go)
    expected = ["does not fit the context", "token id 288 outside the vocabulary [0, 288)",
                "token id -1 outside", "input_ids is empty", "temperature=-1.0", "top_p=0.0",
                "top_k=0", "stop strings need", "num_prefix_tokens must be >= 0"]
    for out, msg in zip(bad, expected):
        assert out.finish_reason == "error" and msg in out.error, (out.rid, out.error)
    assert all(o.finish_reason == "length" and len(o.output_ids) == 16 for o in outs)
    assert dup.finish_reason == "error" and "already in flight" in dup.error


def test_non_finite_logits_fail_only_that_request(overlap: bool) -> None:
    model = make_model(seed=2)
    poison = 200
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("nan")
    reference = make_model(seed=2)

    async def go():
        engine = make_engine(model, max_batch_size=4, overlap=overlap)
        # Seeded, so that whether a request samples the poisoned token itself is fixed.
        sp = [SamplingParams(max_new_tokens=16, seed=s, ignore_eos=True) for s in range(7)]
        tasks = [asyncio.create_task(_gen(engine, f"ok{i}", [5 + i, 9, 11], sp[i])) for i in range(3)]
        tasks.append(asyncio.create_task(_gen(engine, "nan", [5, poison] + list(range(6, 16)))))
        outs = await asyncio.gather(*tasks)
        # The poisoned request's slot is reused afterwards: later requests must be clean.
        later = await asyncio.gather(*(_gen(engine, f"later{i}", [7, 8 + i], sp[3 + i]) for i in range(4)))
        await engine.close()
        return outs, later

    outs, later = run(go)
    assert outs[3].finish_reason == "error" and "non-finite logits" in outs[3].error
    for out, prompt in [(o, [5 + i, 9, 11]) for i, o in enumerate(outs[:3])] + \
                       [(o, [7, 8 + i]) for i, o in enumerate(later)]:
        assert out.finish_reason == "length"
        ids = torch.tensor([prompt + out.output_ids])
        with torch.no_grad():
            lp = token_logprobs(reference(ids).logits[0, len(prompt) - 1 : -1], torch.tensor(out.output_ids))
        assert (lp - torch.tensor(out.logprobs)).abs().max() < 1e-5


def test_step_exception_fails_running_requests_and_engine_recovers(monkeypatch, overlap: bool) -> None:
    async def go():
        engine = make_engine(overlap=overlap)
        real = engine.runner.decode
        calls = {"n": 0}

        def flaky(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("simulated device error")
            return real(*a, **kw)

        monkeypatch.setattr(engine.runner, "decode", flaky)
        first = await _gen(engine, "a", [5, 6])
        second = await _gen(engine, "b", [5, 6])
        await engine.close()
        return first, second

    first, second = run(go)
    assert first.finish_reason == "error" and "simulated device error" in first.error
    assert len(first.output_ids) == 3  # the partial output is kept
    assert second.finish_reason == "length" and len(second.output_ids) == 16


def test_bad_engine_config() -> None:
    model = make_model()
    for kw, msg in [(dict(max_seq_len=4096), "max_seq_len 4096"), (dict(max_batch_size=0), "max_batch_size"),
                    (dict(dtype="int8"), "dtype 'int8'"), (dict(decode_attention="flash"), "decode_attention"),
                    (dict(decode_attention_chunk=100), "decode_attention_chunk"),
                    (dict(decode_attention_chunk=32), "power of two >= 64")]:
        with pytest.raises(ValueError, match=msg):
            make_engine(model, **kw)
    assert EngineConfig().torch_dtype() == torch.float32


def test_triton_decode_attention_needs_a_gpu(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tests' CPU interpreter off: as on a user's CPU
    with pytest.raises(ValueError, match="decode_attention 'triton' cannot run here: the kernel needs triton and a CUDA device"):
        make_engine(make_model(), decode_attention="triton")
