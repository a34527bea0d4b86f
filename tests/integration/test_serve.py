"""``miles serve`` speaks SGLang's HTTP protocol: generation, streaming, errors, abort and
resume, pause and continue, info endpoints — against a real server subprocess.

The weights never change in this module (weight updates: test_serve_weights.py), so every
log-prob can be checked against the checkpoint itself.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.engines import EmbeddedEngine, EngineConfig
from miles.models import build_tiny_tokenizer
from miles.types import GenerateRequest, SamplingParams

from .serve_util import full_forward_logprobs, load, make_checkpoint, request, run, serve, stream, wait_running

TOL = 1e-5
PROMPT = [17, 90, 33, 140, 7, 201]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ck = make_checkpoint(tmp_path_factory.mktemp("ck"))
    # Several tests here act on requests in mid-generation (abort, pause, a stream's chunks):
    # the torch-ops decode path keeps 200 tokens at ~0.1 s, where the CPU kernel takes ~20 ms,
    # less than the tests' HTTP round trips. A 2 ms stream interval: several chunks a stream.
    with serve(ck, "--max-seq-len", "512", "--max-batch-size", "8", "--stream-interval-s", "0.002",
               "--no-cpu-decode-kernel", log_dir=tmp_path_factory.mktemp("log")) as url:
        yield url, ck


def _generate(url, body):
    status, data = run(request(url, "/generate", body))
    assert status == 200, data
    return data


def _tokens(meta):
    return [e[1] for e in meta["output_token_logprobs"]], [e[0] for e in meta["output_token_logprobs"]]


def test_generate_single_batch_and_text(server) -> None:
    url, _ = server
    sp = {"max_new_tokens": 12, "temperature": 0.7, "sampling_seed": 5, "ignore_eos": True}
    one = _generate(url, {"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True, "rid": "single"})
    meta = one["meta_info"]
    ids, lps = _tokens(meta)
    assert one["output_ids"] == ids and len(ids) == 12 == meta["completion_tokens"]
    assert meta["id"] == "single" and meta["prompt_tokens"] == len(PROMPT)
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["weight_version"] == "0" and meta["weight_versions"] == [{"version": "0", "start": 0, "end": 12}]
    assert all(e[2] is None for e in meta["output_token_logprobs"]) and all(lp < 0 for lp in lps)
    assert one["text"] == build_tiny_tokenizer().decode(ids)

    batch = _generate(url, {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": sp, "rid": ["b0", "b1"]})
    assert [b["meta_info"]["id"] for b in batch] == ["b0", "b1"]
    assert batch[0]["output_ids"] == ids  # same seed, same prompt: same tokens in a batch
    assert "output_token_logprobs" not in batch[0]["meta_info"]

    text = "hello there"
    by_text = _generate(url, {"text": text, "sampling_params": sp})
    by_ids = _generate(url, {"input_ids": build_tiny_tokenizer().encode(text), "sampling_params": sp})
    assert by_text["output_ids"] == by_ids["output_ids"]


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_logprobs_match_the_engine_and_a_full_forward(server, temperature) -> None:
    url, ck = server
    sp = {"max_new_tokens": 24, "temperature": temperature, "sampling_seed": 11, "ignore_eos": True}
    meta = _generate(url, {"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True})["meta_info"]
    ids, lps = _tokens(meta)

    model = load(ck)
    ref = full_forward_logprobs(model, PROMPT, ids, temperature if temperature > 0 else 1.0)
    assert (ref - torch.tensor(lps)).abs().max().item() < TOL

    engine = EmbeddedEngine(load(ck), config=EngineConfig(max_batch_size=2, max_seq_len=512,
                                                          cpu_decode_kernel=False))  # as the server
    req = GenerateRequest(rid="local", input_ids=PROMPT, sampling=SamplingParams(
        max_new_tokens=24, temperature=temperature, seed=11, ignore_eos=True))

    async def local():
        out = await engine.generate(req)
        await engine.close()
        return out

    out = run(local())
    assert out.output_ids == ids
    assert (torch.tensor(out.logprobs) - torch.tensor(lps)).abs().max().item() < TOL


def test_stream_sends_cumulative_chunks_then_done(server) -> None:
    url, _ = server
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 160, "sampling_seed": 2, "ignore_eos": True}}
    events = run(stream(url, body))
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = events[:-1]
    for prev, nxt in zip(chunks, chunks[1:]):
        assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
        assert len(prev["meta_info"]["output_token_logprobs"]) == len(prev["output_ids"])
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    whole = _generate(url, body)
    assert final["output_ids"] == whole["output_ids"]


@pytest.mark.parametrize("body, field", [
    ({"input_ids": PROMPT, "text": "x"}, "exactly one"),
    ({"input_ids": PROMPT, "sampling_params": {"min_p": 0.1}}, "min_p"),
    ({"input_ids": PROMPT, "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"input_ids": PROMPT, "sampling_params": {"frobnicate": 1}}, "frobnicate"),
    ({"input_ids": PROMPT, "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": PROMPT, "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [5, 99999]}, "vocabulary"),
    ({"input_ids": [5] * 600}, "context length"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": PROMPT, "logprob_start_len": 0}, "logprob_start_len"),
    ({"input_ids": [PROMPT, PROMPT], "stream": True}, "streaming a batch"),
    ({"input_ids": PROMPT, "return_routed_experts": True}, "mixture-of-experts"),
    ({"input_ids": PROMPT, "lora_path": "x"}, "lora_path"),
    ({"input_ids": [PROMPT, PROMPT], "rid": ["a", "a"]}, "distinct"),
])
def test_bad_requests_get_400_naming_the_field(server, body, field) -> None:
    url, _ = server
    status, data = run(request(url, "/generate", body))
    assert status == 400 and field in data["error"]["message"], data


def test_bad_json_and_the_server_keeps_serving(server) -> None:
    url, _ = server
    status, data = run(request(url, "/generate", raw=b"{not json"))
    assert status == 400 and "JSON" in data["error"]["message"]
    status, data = run(request(url, "/pause_generation", {"mode": "sideways"}))
    assert status == 400 and "sideways" in data["message"]
    status, data = run(request(url, "/update_weights_from_tensor", {"serialized_named_tensors": ["gAR9"]}))
    assert status == 400 and "unpickles" in data["message"]
    assert _generate(url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})["output_ids"]


def test_abort_returns_partial_tokens_and_resume_continues(server) -> None:
    url, _ = server
    sp = {"max_new_tokens": 250, "temperature": 1.0, "sampling_seed": 9, "ignore_eos": True}

    async def go():
        task = asyncio.ensure_future(request(url, "/generate", {
            "input_ids": PROMPT, "sampling_params": sp, "return_logprob": True, "rid": "job-1-sample-0"}))
        await wait_running(url)
        status, _ = await request(url, "/abort_request", {"rid": "job-1"})  # prefix match
        assert status == 200
        return (await task)[1]

    partial = run(go())
    meta = partial["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    prefix, prefix_lps = _tokens(meta)
    assert 0 < len(prefix) < 250 and partial["output_ids"] == prefix

    resumed = _generate(url, {
        "input_ids": PROMPT + prefix, "return_logprob": True,
        "sampling_params": {**sp, "max_new_tokens": 250 - len(prefix),
                            "custom_params": {"miles_num_prefix_tokens": len(prefix)}}})
    rest, rest_lps = _tokens(resumed["meta_info"])
    whole = _generate(url, {"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True})
    whole_ids, whole_lps = _tokens(whole["meta_info"])
    assert prefix + rest == whole_ids  # seeded draws: the resume reproduces the uninterrupted run
    assert max(abs(a - b) for a, b in zip(prefix_lps + rest_lps, whole_lps)) < TOL


def test_abort_all_and_unknown_rid(server) -> None:
    url, _ = server
    sp = {"max_new_tokens": 400, "ignore_eos": True}

    async def go():
        tasks = [asyncio.ensure_future(request(url, "/generate", {
            "input_ids": PROMPT, "sampling_params": sp, "rid": f"all-{i}"})) for i in range(3)]
        await wait_running(url, 3)
        status, data = await request(url, "/generate", {"input_ids": PROMPT, "rid": "all-1"})
        assert status == 400 and "already in flight" in data["error"]["message"]
        assert (await request(url, "/abort_request", {"rid": "no-such-request"}))[0] == 200
        assert (await request(url, "/abort_request", {"abort_all": True}))[0] == 200
        return [(await t)[1] for t in tasks]

    outs = run(go())
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert all(0 < o["meta_info"]["completion_tokens"] < 400 for o in outs)


def test_pause_in_place_freezes_and_continue_resumes(server) -> None:
    url, _ = server
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}

    async def go():
        running = asyncio.ensure_future(request(url, "/generate", body))
        await wait_running(url)
        status, data = await request(url, "/pause_generation", {"mode": "in_place"})
        assert status == 200 and data["status"] == "ok"
        flush_status, _ = await request(url, "/flush_cache")
        assert flush_status == 400  # a request is still in the batch
        assert (await request(url, "/health_generate", method="GET"))[0] == 200
        late = asyncio.ensure_future(request(url, "/generate", {**body, "rid": "late"}))
        await asyncio.sleep(0.3)
        assert not running.done() and not late.done()  # nothing moves while paused
        _, loads = await request(url, "/v1/loads", method="GET")
        assert loads["loads"][0]["num_running_reqs"] == 1 and loads["loads"][0]["num_waiting_reqs"] == 1
        assert (await request(url, "/continue_generation", {}))[0] == 200
        return (await running)[1], (await late)[1]

    first, late = run(go())
    assert first["meta_info"]["finish_reason"]["type"] == "length" and len(first["output_ids"]) == 200
    assert late["meta_info"]["finish_reason"]["type"] == "length"
    assert run(request(url, "/flush_cache"))[0] == 200  # idle now


def test_pause_abort_aborts_running_and_holds_new_requests(server) -> None:
    url, _ = server
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}

    async def go():
        running = asyncio.ensure_future(request(url, "/generate", body))
        await wait_running(url)
        assert (await request(url, "/pause_generation", {}))[0] == 200  # default mode: abort
        aborted = (await running)[1]
        late = asyncio.ensure_future(request(url, "/generate", {**body, "rid": "after-pause"}))
        await asyncio.sleep(0.2)
        assert not late.done()
        await request(url, "/continue_generation", {})
        return aborted, (await late)[1]

    aborted, late = run(go())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert late["meta_info"]["finish_reason"]["type"] == "length"


def test_info_endpoints(server) -> None:
    url, ck = server

    async def go():
        return {path: await request(url, path, method="GET")
                for path in ("/health", "/health_generate", "/model_info", "/get_weight_version",
                             "/server_info", "/v1/loads")}

    res = run(go())
    assert all(status == 200 for status, _ in res.values())
    info = res["/model_info"][1]
    assert info["weight_version"] == "0" and info["is_generation"] and info["model_path"] == str(ck)
    assert res["/get_weight_version"][1] == {"weight_version": "0"}
    server_info = res["/server_info"][1]
    assert server_info["tp_size"] == 1 and server_info["max_seq_len"] == 512
    load = res["/v1/loads"][1]["loads"][0]
    assert {"num_running_reqs", "num_waiting_reqs", "max_running_requests"} <= set(load)
