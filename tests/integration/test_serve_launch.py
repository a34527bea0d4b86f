"""The adapter launching its own server, with a mixture-of-experts model: the launch path
(command line, health wait, shutdown) runs for real with ``python -m miles serve`` in place
of ``python -m sglang.launch_server``, and routed experts (R3) travel as SGLang sends them.
"""

from __future__ import annotations

import base64
import os
import sys

import numpy as np
import pytest
import torch

from miles.engines.sglang import SGLangConfig, SGLangEngine, SGLangError
from miles.types import GenerateRequest, SamplingParams

from .serve_util import REPO, full_forward_logprobs, load, make_checkpoint, request, run

TOL = 1e-5
PROMPT = [3, 141, 59, 26, 53, 58]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    ck = make_checkpoint(tmp_path_factory.mktemp("moe"), seed=2, moe=True)
    config = SGLangConfig(
        sglang_launch=True, sglang_launch_command=[sys.executable, "-m", "miles", "serve"], sglang_port=0,
        sglang_server_args={"max_seq_len": 256, "max_batch_size": 4,
                            # what a run under routing replay adds; `miles serve` accepts it
                            "enable_return_routed_experts": True},
        sglang_startup_timeout_s=180)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(REPO)
    try:
        eng = SGLangEngine(config, model_path=str(ck), version=3, seed=7)
        run(eng.start())
    finally:
        os.environ.pop("PYTHONPATH") if old is None else os.environ.__setitem__("PYTHONPATH", old)
    yield eng, ck
    run(eng.close())


def test_launch_command_and_start(launched) -> None:
    eng, ck = launched
    argv = eng._process.argv
    assert argv[:4] == [sys.executable, "-m", "miles", "serve"]
    assert argv[argv.index("--model-path") + 1] == str(ck) and "--max-seq-len" in argv
    assert argv[argv.index("--weight-version") + 1] == "3" and argv[argv.index("--random-seed") + 1] == "7"
    assert eng.version == 3  # the server was started at the adapter's version


def test_routed_experts_match_a_full_forward(launched) -> None:
    eng, ck = launched
    req = GenerateRequest(rid="moe-0", input_ids=PROMPT, return_routed_experts=True,
                          sampling=SamplingParams(max_new_tokens=16, seed=1, ignore_eos=True))
    out = run(eng.generate(req))
    assert out.finish_reason == "length" and out.versions == [3] * 16
    model = load(ck)
    with torch.no_grad():
        fwd = model(torch.tensor([PROMPT + out.output_ids]), return_routing=True)
    # response token i was produced by the forward step at position P - 1 + i
    assert torch.equal(torch.tensor(out.routed_experts), fwd.routing[0, len(PROMPT) - 1 : -1])
    ref = full_forward_logprobs(model, PROMPT, out.output_ids, 1.0)
    assert (ref - torch.tensor(out.logprobs)).abs().max().item() < TOL


def test_routed_experts_wire_format(launched) -> None:
    eng, _ = launched
    cfg = load(launched[1]).config
    layers, top_k = len(cfg.moe_layers), cfg.num_experts_per_tok
    for start in (0, len(PROMPT) + 2):
        status, data = run(request(eng.url, "/generate", {
            "input_ids": PROMPT, "return_routed_experts": True, "routed_experts_start_len": start,
            "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}))
        assert status == 200
        meta = data["meta_info"]
        first = max(start, len(PROMPT) - 1)  # the server has no routing for prompt positions
        assert meta["routed_experts_start_len"] == first
        arr = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        assert arr.size == (len(PROMPT) + 8 - 1 - first) * layers * top_k


def test_close_stops_the_launched_server(launched) -> None:
    eng, _ = launched
    run(eng.close())
    assert not eng._process.alive()
    with pytest.raises(OSError):
        run(request(eng.url, "/health", method="GET"))


def test_a_server_that_dies_at_start_is_reported(tmp_path) -> None:
    config = SGLangConfig(sglang_launch=True, sglang_port=0, sglang_startup_timeout_s=60,
                          sglang_launch_command=[sys.executable, "-c", "print('no model here'); raise SystemExit(3)"])
    eng = SGLangEngine(config, model_path=str(tmp_path))
    with pytest.raises(SGLangError, match="exited before it was healthy(.|\n)*no model here"):
        run(eng.start())
    run(eng.close())
