"""SGLang adapter without a server: the launch command line, the config checks, request
bodies, and reading responses the way SGLang 0.5.15.post1 and 0.5.23 write them."""

from __future__ import annotations

import base64
import importlib.util
import sys

import numpy as np
import pytest

from miles.engines.sglang import SGLangConfig, SGLangEngine, build_launch_command
from miles.engines.sglang.launch import ServerProcess, render_flags
from miles.engines.sglang.responses import (
    decode_routed,
    finish_from,
    generate_body,
    output_from_response,
    parse_version_label,
    versions_from_spans,
)
from miles.types import GenerateRequest, SamplingParams


def test_launch_command_defaults_and_passthrough() -> None:
    cfg = SGLangConfig(sglang_launch=True, sglang_port=31000, sglang_server_args={
        "tp_size": 2, "--mem-fraction-static": 0.8, "enable_return_routed_experts": True,
        "skip_server_warmup": False, "chunked_prefill_size": None, "json_model_override_args": {"a": 1},
        "cuda_graph_bs": [1, 2, 4]})
    argv, url = build_launch_command(cfg, model_path="/ckpt", port=31002, weight_version=5, seed=11)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = argv[3:]
    assert flags[:10] == ["--model-path", "/ckpt", "--host", "127.0.0.1", "--port", "31002",
                          "--weight-version", "5", "--random-seed", "11"]
    assert flags[flags.index("--tp-size") + 1] == "2"
    assert flags[flags.index("--mem-fraction-static") + 1] == "0.8"
    assert "--enable-return-routed-experts" in flags
    assert "--skip-server-warmup" not in flags and "--chunked-prefill-size" not in flags
    assert flags[flags.index("--json-model-override-args") + 1] == '{"a": 1}'
    i = flags.index("--cuda-graph-bs")
    assert flags[i + 1 : i + 4] == ["1", "2", "4"]
    assert url == "http://127.0.0.1:31002"


def test_passthrough_overrides_our_flags_and_the_url_follows() -> None:
    cfg = SGLangConfig(sglang_launch=True, sglang_server_args={"port": 40000, "host": "::1"},
                       sglang_launch_command=["python", "-m", "miles", "serve"])
    argv, url = build_launch_command(cfg, model_path="/m", port=30000, weight_version=0)
    assert argv[:4] == ["python", "-m", "miles", "serve"]
    assert argv.count("--port") == 1 and argv[argv.index("--port") + 1] == "40000"
    assert url == "http://[::1]:40000"
    assert render_flags({"x_y": True, "z": 0}) == ["--x-y", "--z", "0"]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_run_settings_become_server_flags_and_passthrough_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routing replay and the speculative section reach a launched server as SGLang's own
    flags; a ``--sglang-*`` flag of the same name overrides them."""
    from miles.config import resolve
    from miles.engines import sglang as sg

    cfg = resolve({"rollout_backend": "sglang", "sglang_launch": True, "use_rollout_routing_replay": True,
                   "speculative_algorithm": "eagle", "speculative_num_steps": 2, "draft_model_path": "/eagle",
                   "sglang_server_args": {"speculative_num_steps": 5}}, check=False)
    assert sg.run_server_args(cfg) == {
        "enable-return-routed-experts": True, "speculative-algorithm": "EAGLE", "speculative-num-steps": 2,
        "speculative-eagle-topk": 1, "speculative-num-draft-tokens": 3, "speculative-draft-model-path": "/eagle"}
    seen = {}

    class Capture:
        def __init__(self, config, **kw) -> None:
            seen["argv"] = build_launch_command(config, model_path="/m", port=1, weight_version=0)[0]

    monkeypatch.setattr(sg, "SGLangEngine", Capture)
    sg.build_sglang_engine(cfg)
    argv = " ".join(seen["argv"])
    assert "--enable-return-routed-experts" in argv and "--speculative-algorithm EAGLE" in argv
    assert "--speculative-num-steps 5" in argv and "--speculative-num-steps 2" not in argv


def test_launching_without_sglang_names_the_extra() -> None:
    argv, _ = build_launch_command(SGLangConfig(sglang_launch=True), model_path="/m", port=1, weight_version=0)
    with pytest.raises(ImportError, match=r"miles\[sglang\]"):
        ServerProcess(argv)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "--sglang-urls"),
    ({"sglang_urls": ["http://a:1"], "sglang_launch": True}, "not both"),
    ({"sglang_urls": ["a:1"]}, "not an http"),
    ({"sglang_urls": ["http://a:1"], "sglang_timeout_s": 0}, "timeout"),
])
def test_config_validation(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SGLangConfig(**kwargs).validate()


def test_adapter_needs_a_url_or_a_launch() -> None:
    with pytest.raises(ValueError, match="url"):
        SGLangEngine(SGLangConfig())


def test_generate_body_for_a_resume() -> None:
    req = GenerateRequest(rid="t1", input_ids=[1, 2, 3, 4], num_prefix_tokens=2, return_routed_experts=True,
                          sampling=SamplingParams(max_new_tokens=10, temperature=0.5, top_k=5, seed=9,
                                                  stop=["</s>"], stop_token_ids=[7]))
    body = generate_body(req)
    sp = body["sampling_params"]
    assert body["rid"] == "t1" and body["input_ids"] == [1, 2, 3, 4] and body["return_logprob"] is True
    assert sp["max_new_tokens"] == 8  # SGLang counts from this call, the engine contract from the prompt
    assert sp["sampling_seed"] == 9 and sp["custom_params"] == {"miles_num_prefix_tokens": 2}
    assert sp["stop"] == ["</s>"] and sp["stop_token_ids"] == [7] and body["return_routed_experts"] is True
    fresh = generate_body(GenerateRequest(rid="t2", input_ids=[1]))
    assert "custom_params" not in fresh["sampling_params"] and "sampling_seed" not in fresh["sampling_params"]


def _response(n=3, *, spans=None, version="4", finish=None, completion=None):
    meta = {"id": "r", "finish_reason": finish or {"type": "length", "length": n}, "weight_version": version,
            "completion_tokens": n if completion is None else completion,
            "output_token_logprobs": [[-0.5 - i, 10 + i, None] for i in range(n)]}
    if spans is not None:
        meta["weight_versions"] = spans
    return {"text": "", "output_ids": [10 + i for i in range(n)], "meta_info": meta}


REQ = GenerateRequest(rid="r", input_ids=[1, 2])


def test_versions_from_0_5_23_spans() -> None:
    spans = [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}]
    out = output_from_response(_response(spans=spans), request=REQ, dispatch_version=2)
    assert out.output_ids == [10, 11, 12] and out.logprobs == [-0.5, -1.5, -2.5]
    assert out.versions == [2, 3, 3] and out.finish_reason == "length"
    assert versions_from_spans(spans, 4, 0) is None  # spans must tile the output exactly
    assert versions_from_spans([{"version": "1", "start": 1, "end": 3}], 2, 0) is None


def test_versions_without_spans_are_the_dispatch_version() -> None:
    """0.5.15.post1 only says the version at emission ("4"); tokens get the version known at
    dispatch (2): a lower bound, so staleness is never under-counted."""
    out = output_from_response(_response(version="4"), request=REQ, dispatch_version=2)
    assert out.versions == [2, 2, 2]


@pytest.mark.parametrize("reason, expected", [
    ({"type": "stop", "matched": 7}, ("stop", 7, None)),
    ({"type": "stop", "matched": "</s>"}, ("stop", "</s>", None)),
    ({"type": "length", "length": 3}, ("length", None, None)),
    ({"type": "abort", "message": "Abort before prefill"}, ("abort", None, None)),
    ({"type": "abort", "message": "too long", "status_code": 400, "err_type": "BadRequestError"},
     ("error", None, "too long")),
    (None, ("error", None, "the response has no finish_reason")),
])
def test_finish_reasons(reason, expected) -> None:
    assert finish_from(reason) == expected


def test_malformed_responses_are_errors_not_exceptions() -> None:
    out = output_from_response({"meta_info": {}}, request=REQ, dispatch_version=0)
    assert out.finish_reason == "error" and "output_token_logprobs" in out.error
    out = output_from_response(_response(completion=5), request=REQ, dispatch_version=0)
    assert out.finish_reason == "error" and "3 output_token_logprobs for 5" in out.error


def test_routed_experts_from_full_and_trimmed_rows() -> None:
    P, n, L, k = 4, 3, 2, 2
    rows = np.arange((P + n - 1) * L * k, dtype=np.int32).reshape(P + n - 1, L, k)
    full = base64.b64encode(rows.tobytes()).decode()
    trimmed = base64.b64encode(rows[P - 1 :].tobytes()).decode()
    a = decode_routed(full, start=0, prompt_len=P, n=n, shape=(L, k))  # stock SGLang
    b = decode_routed(trimmed, start=P - 1, prompt_len=P, n=n, shape=(L, k))  # miles serve
    assert a == b == rows[P - 1 :].tolist()
    with pytest.raises(ValueError, match="rows"):
        decode_routed(trimmed, start=0, prompt_len=P, n=n, shape=(L, k))


def test_version_labels() -> None:
    assert parse_version_label("7", 0) == 7 and parse_version_label("default", 3) == 3
    with pytest.raises(ValueError, match="--weight-version"):
        parse_version_label("v1.2", 0)
