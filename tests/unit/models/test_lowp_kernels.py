"""The decode-sized low-precision kernels (``miles.kernels.lowp_triton`` through ``lowp``'s
launchers) against the quantizer's torch arithmetic: on the CPU in triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET; small shapes, float16/float32 inputs: the
interpreter's bf16 dot is broken), in bf16 on CUDA. The W4A16 kernel and the block-scaled
FP8 GEMM must equal the dequantized product to round-off; the activation quantizer must equal
``quantize.fp8_quantize_act`` bit for bit (the engine's and the trainer's FP8 values)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles.kernels import decode_attention, lowp
from miles.kernels.quantize import (BLOCK, fp8_dequantize_weight, fp8_quantize_act, fp8_quantize_weight,
                                    int4_dequantize, int4_quantize, pack_int4)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not decode_attention.available(DEVICE),
                                  reason="needs triton (CUDA, or its CPU interpreter with numpy < 2.4)")
FP8_OK = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (8, 9)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())


def _int4(N: int, K: int, group: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = int4_quantize(torch.randn(N, K, generator=g) * 0.05, group)
    return pack_int4(q).to(DEVICE), s.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("cfg", [dict(DOT=False, BN=16, UNROLL=2, split=0, MAGIC=True),
                                 dict(DOT=False, BN=32, UNROLL=1, split=2, MAGIC=False),
                                 dict(DOT=True, BN=16, UNROLL=2, split=1, MAGIC=True),
                                 dict(DOT=True, BN=32, UNROLL=1, split=4, MAGIC=False),
                                 dict(DOT=False, BN=16, UNROLL=2, split=2, ACC2D=True)])
def test_w4a16_decode_kernel_matches_the_dequantized_product(M: int, cfg: dict) -> None:
    g = torch.Generator().manual_seed(M)
    N, K, group = 40, 256, 32  # N not a multiple of the tile
    packed, scale = _int4(N, K, group, g)
    dtype = torch.float16 if cfg["DOT"] else torch.float32
    if DEVICE == "cuda":
        dtype = torch.bfloat16 if cfg["DOT"] else dtype
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    from miles.kernels.quantize import unpack_int4

    ref = F.linear(x.float(), int4_dequantize(unpack_int4(packed), scale))
    got = lowp._int4_small(x, packed, scale, group, dict(cfg, warps=4, stages=2))
    assert got.shape == (M, N) and got.dtype == dtype
    assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 4e-3)
    again = lowp._int4_small(x, packed, scale, group, dict(cfg, warps=4, stages=2))
    assert torch.equal(got, again)  # no atomics: the split-K sum is in a fixed order


@needs_triton
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("cfg", [dict(path="gemv", BN=16, U=2, split=1),
                                 dict(path="gemv", BN=32, U=4, split=0, programs=8),
                                 dict(path="dott", BN=16, U=2, split=1, JOIN=False, NIB16=True),
                                 dict(path="dott", BN=32, U=1, split=2, JOIN=True),
                                 dict(path="dott", BN=16, U=4, split=0, programs=8, JOIN=True, NIB16=True),
                                 dict(path="gemv", BN=16, U=1, split=2, PF=True, INPLACE=True),
                                 dict(path="gemv", BN=16, U=2, split=2, XP=True),
                                 dict(path="dott", BN=16, U=2, split=1, JOIN=True, NIB16=2),
                                 dict(path="dott", BN=32, U=1, split=2, JOIN=False, NIB16=2, PF=True),
                                 dict(path="dott", BN=16, U=1, split=2, JOIN=True, NIB16=2, PF=True, SWAP=True)])
def test_word_wise_w4a16_kernels_match_the_dequantized_product(M: int, cfg: dict) -> None:
    """The int32-word kernels: N not a multiple of the tile, two K slices or one, group 128."""
    g = torch.Generator().manual_seed(M)
    N, K, group = 40, 512, 128
    packed, scale = _int4(N, K, group, g)
    dot = cfg["path"] == "dott"
    dtype = (torch.bfloat16 if DEVICE == "cuda" else torch.float16) if dot else torch.float32
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    from miles.kernels.quantize import unpack_int4

    ref = F.linear(x.float(), int4_dequantize(unpack_int4(packed), scale))
    got = lowp._int4_words(x, packed, scale, group, dict(cfg, warps=4, stages=2))
    assert got.shape == (M, N) and got.dtype == dtype
    assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 4e-3)
    assert torch.equal(got, lowp._int4_words(x, packed, scale, group, dict(cfg, warps=4, stages=2)))


@needs_triton
@pytest.mark.parametrize("cfg", [dict(path="gemv", BN=16, U=1, split=4, PF=True, INPLACE=True),
                                 dict(path="dott", BN=16, U=1, split=2, JOIN=True, NIB16=2, PF=True, SWAP=True),
                                 dict(path="dott", BN=16, U=2, split=2, JOIN=True, NIB16=1)])
def test_split_k_summed_in_the_kernel_is_the_second_launchs_sum_bit_for_bit(cfg: dict) -> None:
    """``RED``: the last program of each tile adds the K slices' partials in slice order, as
    ``sum_splits`` does (the same bits, call after call), and leaves the tile counters at zero."""
    g = torch.Generator().manual_seed(5)
    N, K, group = 40, 512, 128
    packed, scale = _int4(N, K, group, g)
    dtype = (torch.bfloat16 if DEVICE == "cuda" else torch.float16) if cfg["path"] == "dott" else torch.float32
    x = torch.randn(3, K, generator=g).to(DEVICE, dtype)
    two = lowp._int4_words(x, packed, scale, group, dict(cfg, warps=4))
    for _ in range(2):
        assert torch.equal(lowp._int4_words(x, packed, scale, group, dict(cfg, warps=4, RED=True)), two)
    assert int(lowp._counters(x.device).abs().sum()) == 0


@needs_triton
def test_int4_dispatch_follows_the_tuned_table_for_small_batches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = dict(DOT=True, BN=64, UNROLL=2, split=4, warps=4, stages=3)
    monkeypatch.setitem(lowp.TUNED, ("int4", 96, 512, 16), kernel)
    assert lowp.int4_config(9, 96, 512, 128, torch.bfloat16) == kernel  # 9 rows take the 16-row bucket's launch
    assert not lowp.int4_config(9, 96, 512, 128, torch.float32)["DOT"]  # no tf32 dot
    assert lowp.int4_config(1, 96, 512, 128, torch.bfloat16)["path"] == "tiled"  # untuned: the tiled GEMM
    assert lowp.int4_config(lowp.SMALL_M + 1, 96, 512, 128, torch.bfloat16) is None
    assert lowp.int4_config(1, 96, 96 * 5, 96, torch.bfloat16) is None  # not a power-of-two group
    words = dict(path="gemv", BN=32, U=4, split=0, warps=4, stages=2)
    monkeypatch.setitem(lowp.TUNED, ("int4", 96, 512, 1), words)
    assert lowp.int4_config(1, 96, 512, 128, torch.bfloat16) == words


@needs_triton
@pytest.mark.skipif(not FP8_OK, reason="e4m3 needs compute capability 8.9")
@pytest.mark.parametrize("M,K", [(1, 256), (5, 384), (19, 200)])
@pytest.mark.parametrize("outer", [False, True])
def test_fp8_activation_kernel_is_the_quantizers_bit_for_bit(M: int, K: int, outer: bool) -> None:
    g = torch.Generator().manual_seed(K)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g) * 3)
    x[0, :BLOCK] = 0.0  # an all-zero group: the scale's floor
    x = x.to(DEVICE)
    want_q, want_s = fp8_quantize_act(x)
    rows = M + 3
    q, s = lowp._fp8_quant_triton(x, rows, outer)
    assert (s.stride(0) == 1) == outer or rows == 1
    same = q[:M].view(torch.uint8) == want_q.view(torch.uint8)
    if DEVICE == "cpu":  # the interpreter's float32 → e4m3 cast drops the carry into the exponent
        wf = want_q.float()  # (a value rounding up to 2^e comes out 2^(e-1)); CUDA's cast is exact
        same |= (q[:M].float() * 2 == wf) & (torch.frexp(wf).mantissa.abs() == 0.5)
    assert same.all()
    assert torch.equal(s[:M], want_s)
    assert not q[M:].float().any()  # the padding rows are zero groups


@needs_triton
@pytest.mark.skipif(not FP8_OK, reason="e4m3 needs compute capability 8.9")
@pytest.mark.parametrize("M", [1, 20])
@pytest.mark.parametrize("path,split", [("triton", 1), ("fused", 1), ("triton", 2), ("fused", 3)])
def test_block_scaled_fp8_gemm_matches_the_dequantized_product(M: int, path: str, split: int) -> None:
    g = torch.Generator().manual_seed(M)
    N, K = 160, 384  # two weight blocks in N, one partial
    # scales far apart from one block / group to the next: a scale applied to the wrong block shows
    w = torch.randn(N, K, generator=g) * torch.exp(torch.randn(2, 3, generator=g) * 2).repeat_interleave(
        BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 3, generator=g) * 2).repeat_interleave(BLOCK, 1)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x, w = x.to(DEVICE, dtype), w.to(DEVICE)
    wq, ws = fp8_quantize_weight(w)
    xq, xs = lowp._fp8_quant_triton(x, M, False)  # the quantizer's values (the test above)
    ref = F.linear(xq.float() * xs.repeat_interleave(BLOCK, -1), fp8_dequantize_weight(wq, ws))
    got = lowp._fp8_triton(x, wq, ws, dtype, dict(path=path, BM=16, BN=32, warps=4, stages=2, split=split))
    assert got.shape == (M, N) and got.dtype == dtype
    assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 4e-3)
