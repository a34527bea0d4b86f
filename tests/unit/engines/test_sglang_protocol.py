"""``miles serve``'s side of the protocol without a server: request parsing, response
building (read back by the adapter's parser), and the flattened-bucket wire layout."""

from __future__ import annotations

import pytest
import torch

from miles.engines.sglang.responses import generate_body, output_from_response
from miles.transports import weight_sync
from miles.serving.protocol import ProtocolError, build_response, finish_reason, parse_generate, version_spans
from miles.types import GenerateRequest, SamplingParams


def _parse(body, **kw):
    args = dict(tokenizer=None, vocab_size=100, max_seq_len=64, is_moe=False) | kw
    return parse_generate(body, **args)


def test_adapter_body_parses_back_to_the_request() -> None:
    req = GenerateRequest(rid="x", input_ids=[1, 2, 3], num_prefix_tokens=4,
                          sampling=SamplingParams(max_new_tokens=20, temperature=0.3, top_p=0.9, top_k=8,
                                                  seed=5, stop_token_ids=[9], ignore_eos=True))
    item = _parse(generate_body(req)).items[0]
    assert item.request == req and item.return_logprob


def test_defaults_and_batches() -> None:
    p = _parse({"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 2}, {}], "rid": ["a", "b"]})
    assert p.batch and not p.stream and [i.request.rid for i in p.items] == ["a", "b"]
    assert [i.request.sampling.max_new_tokens for i in p.items] == [2, 128]
    single = _parse({"input_ids": [1], "sampling_params": {"skip_special_tokens": False, "n": 1, "min_p": 0}})
    assert not single.batch and single.items[0].text_options["skip_special_tokens"] is False


@pytest.mark.parametrize("body, message", [
    ([], "JSON object"),
    ({"input_ids": [1], "rid": ["a"]}, "rid must be"),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "batch of 2"),
    ({"input_ids": [1], "sampling_params": {"stop": ""}}, "stop"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"stop": "x"}}, "tokenizer"),
    ({"text": "hi"}, "tokenizer"),
    ({"input_ids": [1], "mystery": 1}, "request.mystery"),
    ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
])
def test_rejections_name_the_problem(body, message) -> None:
    with pytest.raises(ProtocolError, match=message):
        _parse(body)


def test_response_reads_back_through_the_adapter() -> None:
    req = GenerateRequest(rid="r", input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4))
    item = _parse(generate_body(req)).items[0]
    versions = [1, 1, 2, 2]
    obj = build_response(item, output_ids=[8, 9, 10, 11], logprobs=[-1.0, -2.0, -3.0, -4.0], versions=versions,
                         finish=finish_reason("stop", matched=11, length=4, error=None), weight_version=2,
                         tokenizer=None)
    meta = obj["meta_info"]
    assert meta["weight_versions"] == [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 4}]
    assert meta["weight_version"] == "2" and meta["finish_reason"] == {"type": "stop", "matched": 11}
    out = output_from_response(obj, request=req, dispatch_version=1)
    assert (out.output_ids, out.logprobs, out.versions, out.finish_reason, out.matched_stop) == (
        [8, 9, 10, 11], [-1.0, -2.0, -3.0, -4.0], versions, "stop", 11)
    err = finish_reason("error", matched=None, length=2, error="non-finite logits")
    assert err["type"] == "abort" and err["status_code"] == 500 and err["message"] == "non-finite logits"
    assert version_spans([]) == []


def test_flattened_bucket_layout_is_tight_and_round_trips() -> None:
    tensors = [("a", torch.arange(3, dtype=torch.bfloat16)), ("b", torch.randn(2, 3)),
               ("c", torch.tensor([True, False, True])), ("d", torch.arange(4, dtype=torch.int64).reshape(2, 2))]
    desc = weight_sync.describe(tensors)
    metas = weight_sync.plan(desc["names"], desc["dtypes"], desc["shapes"])
    assert [m.offset for m in metas] == [0, 6, 30, 33]  # SGLang's layout: no padding
    flat = weight_sync.flatten(tensors, "cpu")
    assert flat.numel() == 33 + 32
    for (name, t), (got_name, got) in zip(tensors, weight_sync.unflatten(flat, metas)):
        assert name == got_name and got.dtype == t.dtype and torch.equal(got, t)


@pytest.mark.parametrize("names, dtypes, shapes, message", [
    (["a"], ["float32", "float32"], [[1]], "different lengths"),
    ([], [], [], "empty"),
    (["a"], ["complex64"], [[1]], "dtype"),
    (["a"], ["float32"], [[-1]], "shape"),
])
def test_bad_transfer_metadata(names, dtypes, shapes, message) -> None:
    with pytest.raises(weight_sync.WeightSyncError, match=message):
        weight_sync.plan(names, dtypes, shapes)
    with pytest.raises(weight_sync.WeightSyncError, match="backend"):
        weight_sync.check_backend("mpi")
