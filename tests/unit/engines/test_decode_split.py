"""Long-tail decode: a few long rows read their long range alone (``DecodeAttention`` with a
split), every other row only the short range — the same attention as the unsplit read, and
the same tokens and log-probs through the engine."""

from __future__ import annotations

import pytest
import torch

from miles.engines import EngineConfig
from miles.engines.kv_cache import DecodeAttention, KVCache
from miles.engines.runner import ModelRunner
from miles.types import GenerateRequest, SamplingParams

from .helpers import make_engine, make_model, prompts
from .spec_helpers import full_logprobs, generate_all


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_split_read_equals_the_full_read(dtype: torch.dtype, tol: float) -> None:
    cfg = make_model().config
    cache = KVCache(cfg, 6, 256, torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(dtype))
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    positions = torch.tensor([3, 200, 7, 31, 150, 0])
    q, k, v = (torch.randn(6, h, 1, D, generator=g).to(dtype) for h in (H, KV, KV))
    full = DecodeAttention(cache, positions, 208, "matmul")(0, q, k, v)
    split = DecodeAttention(cache, positions, 208, "matmul", split=(32, torch.tensor([1, 4])))(0, q, k, v)
    assert split.dtype == full.dtype and (split.float() - full.float()).abs().max().item() < tol


def test_choose_split_reads_less_only_when_it_pays() -> None:
    runner = ModelRunner(make_model(), EngineConfig(max_batch_size=8, max_seq_len=512, kv_block=16))
    assert runner.split  # auto: on for the CPU's eager decode
    S, rows, read = runner.choose_split([10, 12, 400, 9, 14, 11, 8, 13], 416)
    assert S == 16 and rows == [2] and read == 8 * 16 + 1 * 400
    assert runner.choose_split([100, 120, 130, 110], 144) is None  # similar lengths: no split


def test_engine_with_split_gives_the_same_tokens() -> None:
    policy = make_model(seed=4)
    short = prompts(5, seed=5, lo=3, hi=6)
    long = torch.randint(5, 260, (180,), generator=torch.Generator().manual_seed(6)).tolist()
    ps = [long, *short]
    sps = [SamplingParams(max_new_tokens=20, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(ps))]
    reqs = lambda: [GenerateRequest(rid=str(i), input_ids=p, sampling=s) for i, (p, s) in enumerate(zip(ps, sps))]
    split_engine = make_engine(policy, max_batch_size=8, kv_block=16, decode_split=True)
    plain_engine = make_engine(policy, max_batch_size=8, kv_block=16, decode_split=False)
    a, b = generate_all(split_engine, reqs()), generate_all(plain_engine, reqs())
    assert split_engine.runner.kv_read < plain_engine.runner.kv_read  # the split read less
    for p, x, y in zip(ps, a, b):
        assert x.output_ids == y.output_ids
        assert max(abs(u - w) for u, w in zip(x.logprobs, y.logprobs)) < 1e-5
        assert (torch.tensor(x.logprobs) - full_logprobs(policy, p, x)).abs().max() < 1e-5
