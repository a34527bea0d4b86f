"""The 8-bit KV cache (``EngineConfig.kv_cache_dtype``) through the torch attention paths on
the CPU: what it stores, how far its log-probs move from the full-precision model's, and the
errors for settings it cannot serve. The Triton kernel's side is in test_triton_decode.py."""

from __future__ import annotations

import pytest
import torch

from miles.engines import EngineConfig
from miles.engines.kv_cache import KVCache
from miles.types import GenerateRequest, SamplingParams

from .helpers import make_engine, make_model, prompts
from .spec_helpers import full_logprobs, generate_all, spec_engine

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _requests(n: int = 4, new: int = 24) -> list[GenerateRequest]:
    return [GenerateRequest(rid=str(i), input_ids=p, sampling=SamplingParams(max_new_tokens=new, seed=i,
                                                                               ignore_eos=True))
            for i, p in enumerate(prompts(n, seed=7, lo=5, hi=40))]


@pytest.mark.parametrize("name", sorted(FP8))
def test_encode_saturates_instead_of_overflowing(name: str) -> None:
    cache = KVCache(make_model().config, 2, 8, torch.device("cpu"), torch.float32, kv_dtype=FP8[name])
    top = torch.finfo(FP8[name]).max
    x = torch.tensor([1e6, -1e6, 0.1, -3.0])
    got = cache.encode(x)
    assert got.dtype == FP8[name] and cache.quantized
    assert cache.decode(got).tolist() == [top, -top, x[2].to(FP8[name]).item(), -3.0]
    plain = KVCache(make_model().config, 2, 8, torch.device("cpu"), torch.float32)
    assert not plain.quantized and plain.encode(x) is x and plain.decode(x) is x
    # NaN is stored as 0: the Triton kernel reads a few positions past each row (zero weight)
    assert cache.decode(cache.encode(torch.tensor([float("nan"), 2.0]))).tolist() == [0.0, 2.0]


@pytest.mark.parametrize("name", sorted(FP8))
def test_an_8bit_cache_stores_v_transposed_and_padded(name: str) -> None:
    """An 8-bit cache's V is a ``[layers, slots, heads, positions, D]`` view of storage whose
    positions are contiguous and padded (``positions_last``); K, and a 16/32-bit cache's V, are
    contiguous. Writes through the view land where a contiguous cache's would."""
    from miles.engines.kv_cache import POSITION_PAD

    cfg = make_model().config
    cache = KVCache(cfg, 3, 20, torch.device("cpu"), torch.float32, kv_dtype=FP8[name], headroom=3)
    assert cache.v.shape == cache.k.shape == (cfg.num_hidden_layers, 3, cfg.num_key_value_heads, 23, cfg.head_dim)
    assert cache.k.is_contiguous() and cache.v.stride(-2) == 1 and cache.v.stride(-1) == POSITION_PAD
    assert (cache.v == 0).all()
    x = torch.randn(cfg.num_key_value_heads, 5, cfg.head_dim)
    cache.v[1, 2, :, 4:9] = cache.encode(x)
    assert torch.equal(cache.decode(cache.v[1, 2, :, 4:9]), cache.decode(cache.encode(x)))
    cache.move_slot(2, 0, 9)
    assert torch.equal(cache.v[1, 0, :, :9], cache.v[1, 2, :, :9])
    plain = KVCache(cfg, 3, 20, torch.device("cpu"), torch.float32)
    assert plain.v.is_contiguous()


@pytest.mark.parametrize("name,tol", [("fp8_e4m3", 0.05), ("fp8_e5m2", 0.1)])
def test_fp8_cache_one_byte_a_value_and_log_probs_near_the_models(name: str, tol: float) -> None:
    """A float32 engine with an 8-bit cache: one byte a K/V value, and the log-probs it
    records for its own samples within ``tol`` (mean) of the model's full-precision forward
    over the same tokens — and not equal to them (the cache really is rounded)."""
    model = make_model()
    engine = make_engine(model, kv_cache_dtype=name)
    cfg = model.config
    assert engine.runner.cache.k.dtype == FP8[name] and engine.runner.cpu_kernel is None
    assert engine.runner.cache.bytes_per_token() == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    requests = _requests()
    outs = generate_all(engine, requests)
    diffs = torch.cat([(torch.tensor(o.logprobs) - full_logprobs(model, r.input_ids, o)).abs()
                       for r, o in zip(requests, outs)])
    assert all(len(o.output_ids) == 24 and o.error is None for o in outs)
    assert 0 < diffs.mean().item() < tol, diffs.mean().item()
    assert diffs.max().item() < 10 * tol


def test_fp8_long_tail_split_and_padded_reads_agree() -> None:
    """The split decode (long rows read past the short range, merged exactly) reads the same
    8-bit cache as the padded one: the same tokens and log-probs."""
    model = make_model()
    requests = _requests(new=16)
    outs = {split: generate_all(make_engine(model, kv_cache_dtype="fp8_e4m3", cpu_decode_kernel=False,
                                            decode_split=split), requests) for split in (False, True)}
    for a, b in zip(outs[False], outs[True]):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)


def test_speculative_engine_runs_on_an_fp8_cache() -> None:
    """Verify steps write and read the 8-bit caches of the policy and the draft."""
    policy = make_model()
    engine = spec_engine(policy, "draft", k=3, kv_cache_dtype="fp8_e4m3")
    assert engine.runner.cache.k.dtype == torch.float8_e4m3fn
    outs = generate_all(engine, _requests(n=3, new=20))
    assert all(len(o.output_ids) == 20 and o.error is None for o in outs)
    assert engine.stepper.stats.counters["spec_rounds"] > 0 and sum(o.spec_accepted_tokens for o in outs) > 0


def test_bad_kv_cache_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' not in auto/fp8_e4m3/fp8_e5m2"):
        make_engine(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="cpu_decode_kernel=True cannot run with kv_cache_dtype 'fp8_e4m3'"):
        make_engine(kv_cache_dtype="fp8_e4m3", cpu_decode_kernel=True)
    # auto leaves an 8-bit cache on the torch path
    assert not EngineConfig(kv_cache_dtype="fp8_e5m2").use_cpu_decode_kernel()
