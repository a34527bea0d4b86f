"""The Triton length-aware decode attention (``miles.kernels.decode_attention``) against a
plain softmax reference, and the engine with ``decode_attention="triton"`` against the
matmul engine. Runs on CUDA, or on the CPU in triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET); skipped where triton is not installed (the default CPU install)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from miles.engines import EmbeddedEngine, EngineConfig
from miles.kernels import decode_attention as kernel
from miles.models import CausalLM, tiny_config
from miles.types import GenerateRequest, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernel.available(DEVICE),
                                reason="needs triton (CUDA, or its CPU interpreter with numpy < 2.4)")


def _reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    out = torch.empty_like(q, dtype=torch.float32)
    D = q.shape[-1]
    for b, n in enumerate(lengths):
        s = torch.einsum("hgd,htd->hgt", q[b].float(), kc[b, :, :n].float()) / math.sqrt(D)
        out[b] = torch.einsum("hgt,htd->hgd", s.softmax(-1), vc[b, :, :n].float())
    return out


@pytest.mark.parametrize("group,head_dim", [(1, 16), (2, 16), (3, 32), (8, 64)])
def test_kernel_matches_softmax_reference(group: int, head_dim: int) -> None:
    g = torch.Generator().manual_seed(group)
    KV, T = 2, 3 * kernel.CHUNK + 40
    # lengths at 1, inside a block, at chunk boundaries and across several chunks
    lengths = [1, 37, kernel.BLOCK_N, kernel.CHUNK, kernel.CHUNK + 1, T]
    n = len(lengths)
    kc = torch.randn(n + 2, KV, T, head_dim, generator=g).to(DEVICE)  # more slots than rows
    vc = torch.randn(n + 2, KV, T, head_dim, generator=g).to(DEVICE)
    q = torch.randn(n, KV, group, head_dim, generator=g).to(DEVICE)
    lens = torch.tensor(lengths, device=DEVICE)
    out = kernel.decode_attention(q, kc, vc, lens, 1 / math.sqrt(head_dim), T)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, _reference(q, kc, vc, lengths), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("G,tokens", [(2, 2), (2, 5), (8, 9)])  # 8 × 9 rows: two launches
def test_kernel_verify_step_is_causal_among_new_tokens(G: int, tokens: int) -> None:
    """Several new tokens per row (a speculative verify): query t sees ``[0, length - T + t]``."""
    g = torch.Generator().manual_seed(tokens)
    KV, D, T = 2, 16, kernel.CHUNK + 70
    lengths = [tokens, tokens + 3, kernel.CHUNK + 1, kernel.CHUNK + tokens - 1, T]  # new tokens across a chunk edge
    n = len(lengths)
    kc = torch.randn(n, KV, T, D, generator=g).to(DEVICE)
    vc = torch.randn(n, KV, T, D, generator=g).to(DEVICE)
    q = torch.randn(n, KV, G * tokens, D, generator=g).to(DEVICE)  # row index g × tokens + t
    out = kernel.decode_attention(q, kc, vc, torch.tensor(lengths, device=DEVICE), 1 / math.sqrt(D), T,
                                  tokens=tokens)
    for b, m in enumerate(lengths):
        for r in range(G * tokens):
            t = r % tokens
            want = _reference(q[b : b + 1, :, r : r + 1], kc[b : b + 1], vc[b : b + 1], [m - tokens + 1 + t])
            torch.testing.assert_close(out[b : b + 1, :, r : r + 1], want, atol=2e-5, rtol=2e-5)


def _attention_case(lengths: list[int], tokens: int, T: int, seed: int, KV: int = 2, G: int = 2, D: int = 32):
    """Random q [n, KV, G·tokens, D], K/V caches of T positions, the rows' lengths and (one
    token) the step's new K/V."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    kc = torch.randn(n, KV, T, D, generator=g).to(DEVICE)
    vc = torch.randn(n, KV, T, D, generator=g).to(DEVICE)
    q = torch.randn(n, KV, G * tokens, D, generator=g).to(DEVICE)
    lens = torch.tensor(lengths, device=DEVICE)
    new_kv = tuple(torch.randn(n, KV, D, generator=g).to(DEVICE) for _ in range(2)) if tokens == 1 else None
    return q, kc, vc, lens, new_kv


def _count_merges(monkeypatch) -> list:
    """The grids of every ``_merge`` launch from now on (the kernel still runs)."""
    merges = []
    real = kernel._merge

    class Counted:
        def __getitem__(self, grid):
            merges.append(grid)
            return real[grid]

    monkeypatch.setattr(kernel, "_merge", Counted())
    return merges


@pytest.mark.parametrize("tokens", [1, 3])
def test_every_launch_attends_alike(tokens: int) -> None:
    """Chunk sizes, tile widths and pipelines compute the same attention: decode steps
    writing their new K/V, and verify steps."""
    T = 600
    q, kc, vc, lens, new_kv = _attention_case([tokens, 40, 300, T], tokens, T, seed=tokens)
    n, D = q.shape[0], q.shape[-1]
    want_k, want_v = kc.clone(), vc.clone()
    if new_kv is not None:
        want_k[torch.arange(n), :, lens - 1], want_v[torch.arange(n), :, lens - 1] = new_kv
    ref = kernel.decode_attention(q, want_k.clone(), want_v.clone(), lens, D ** -0.5, T, tokens=tokens,
                                  launch=(256, 64, 4, 1))
    for launch in ((256, 32, 4, 2), (512, 64, 4, 2), (512, 32, 8, 3), (128, 16, 4, 4), (1024, 64, 4, 2)):
        k, v = kc.clone(), vc.clone()
        out = kernel.decode_attention(q, k, v, lens, D ** -0.5, T, tokens=tokens, new_kv=new_kv, launch=launch)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("one_chunk_grid", [False, True])
def test_one_chunk_rows_stored_by_the_partial_program_match_the_merge(tokens: int, one_chunk_grid: bool,
                                                                      monkeypatch) -> None:
    """``direct`` (the default): a row of at most CHUNK positions gets its output from its one
    ``_partial`` program; bitwise what the merge makes of it, next to rows that do merge. A
    grid of one chunk (every row that short) launches no merge at all."""
    merges = _count_merges(monkeypatch)
    chunk = 128
    T = chunk if one_chunk_grid else 3 * chunk + 5
    lengths = [tokens, 7, chunk - 1, chunk] + ([] if one_chunk_grid else [chunk + 1, 2 * chunk, T])
    q, kc, vc, lens, new_kv = _attention_case(lengths, tokens, T, seed=10 + tokens)
    D = q.shape[-1]
    outs = [kernel.decode_attention(q, kc.clone(), vc.clone(), lens, D ** -0.5, T, tokens=tokens, new_kv=new_kv,
                                    launch=(chunk, 32, 4, 2), direct=direct) for direct in (True, False)]
    assert torch.equal(outs[0], outs[1])
    assert torch.isfinite(outs[0]).all()
    assert len(merges) == (1 if one_chunk_grid else 2)  # direct=False always merges


def _rope_case(dtype: torch.dtype, qk_norm: bool, seed: int = 4):
    """Raw q/k/v projections laid out as the engine's qkv GEMM leaves them (views of one
    [n, H + 2·KV, D] buffer), each row's RoPE entries, and the q/k-norm weights."""
    from miles.models.layers import Rotary

    g = torch.Generator().manual_seed(seed)
    KV, G, D, T = 2, 3, 32, 2 * kernel.CHUNK + 9
    H = KV * G
    lengths = [1, 2, 40, kernel.CHUNK, kernel.CHUNK + 1, T]
    n = len(lengths)
    qkv = (3 * torch.randn(n, H + 2 * KV, D, generator=g)).to(DEVICE, dtype)
    q, k, v = qkv.split((H, KV, KV), dim=1)
    kc = torch.randn(n + 1, KV, T, D, generator=g).to(DEVICE, dtype)
    vc = torch.randn(n + 1, KV, T, D, generator=g).to(DEVICE, dtype)
    rotary = Rotary(tiny_config(head_dim=D, rope_theta=1000.0))
    pos = torch.tensor(lengths, device=DEVICE) - 1
    cos, sin = (t.reshape(n, D) for t in rotary(pos[:, None], dtype))
    norms = [(torch.rand(D, generator=g) + 0.5).to(DEVICE, dtype) for _ in range(2)] if qk_norm else [None, None]
    return q, k, v, kc, vc, pos + 1, cos, sin, norms


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_applies_qk_norm_and_rope_to_raw_projections(dtype: torch.dtype, qk_norm: bool) -> None:
    """``rope``: the kernel's q/k-norm + RoPE of the raw projections is the compiled layer
    path's (``fused.rms_norm``, ``fused.rope_qk``): the same attention, the same K written."""
    from miles.models.fused import rms_norm, rope_qk

    q, k, v, kc, vc, lens, cos, sin, (qn, kn) = _rope_case(dtype, qk_norm)
    n, H, D = q.shape
    KV = k.shape[1]
    qr, kr = (q, k) if not qk_norm else (rms_norm(q, qn, 1e-6), rms_norm(k, kn, 1e-6))
    qr, kr = rope_qk(qr[:, None], kr[:, None], cos[:, None, None], sin[:, None, None])  # [n, heads, 1, D]
    want_k, want_v = kc.clone(), vc.clone()
    ref = kernel.decode_attention(qr.reshape(n, KV, H // KV, D), want_k, want_v, lens, D ** -0.5, kc.shape[2],
                                  new_kv=(kr[:, :, 0], v))
    out = kernel.decode_attention(q.view(n, KV, H // KV, D), kc, vc, lens, D ** -0.5, kc.shape[2], new_kv=(k, v),
                                  rope=kernel.Rope(cos, sin, qn, kn, 1e-6))
    # float32: only the sum of squares' order differs; bf16: that can move a value by one ulp
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kc.float(), want_k.float(), atol=tol, rtol=tol)
    assert torch.equal(vc, want_v)
    if dtype == torch.float32 or DEVICE == "cuda":  # the interpreter's bf16 dots are not the GPU's
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_rope_is_refused_where_the_kernel_cannot_apply_it() -> None:
    q, k, v, kc, vc, lens, cos, sin, (qn, kn) = _rope_case(torch.float32, True)
    n, H, D = q.shape
    qg = q.view(n, 2, H // 2, D)
    with pytest.raises(ValueError, match="new_kv"):
        kernel.decode_attention(qg, kc, vc, lens, 0.2, kc.shape[2], rope=kernel.Rope(cos, sin, qn, kn, 1e-6))
    with pytest.raises(ValueError, match="both or neither"):
        kernel.decode_attention(qg, kc, vc, lens, 0.2, kc.shape[2], new_kv=(k, v),
                                rope=kernel.Rope(cos, sin, qn, None, 1e-6))
    with pytest.raises(ValueError, match="rope.cos"):
        kernel.decode_attention(qg, kc, vc, lens, 0.2, kc.shape[2], new_kv=(k, v),
                                rope=kernel.Rope(cos[:2], sin, qn, kn, 1e-6))


def test_kernel_never_reads_past_a_rows_length() -> None:
    """Positions past each row's length hold NaN: a read of any of them would show."""
    g = torch.Generator().manual_seed(0)
    n, KV, G, D, T = 3, 2, 2, 16, 2 * kernel.CHUNK
    lengths = [5, kernel.CHUNK + 3, T - 1]
    kc = torch.randn(n, KV, T, D, generator=g)
    vc = torch.randn(n, KV, T, D, generator=g)
    for b, m in enumerate(lengths):
        kc[b, :, m:] = float("nan")
        vc[b, :, m:] = float("nan")
    q = torch.randn(n, KV, G, D, generator=g)
    kc, vc, q = kc.to(DEVICE), vc.to(DEVICE), q.to(DEVICE)
    out = kernel.decode_attention(q, kc, vc, torch.tensor(lengths, device=DEVICE), 0.25, T)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _reference(q, kc, vc, lengths), atol=2e-5, rtol=2e-5)  # 0.25 = 1/√16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_the_new_kv_and_attends_to_it(dtype: torch.dtype) -> None:
    """``new_kv``: the kernel writes each row's new K/V at ``length - 1`` (every chunk edge
    case), exactly what the index_put it replaces wrote, leaves every other position alone
    (the slots past the rows too), and attends over the cache as written."""
    g = torch.Generator().manual_seed(3)
    KV, G, D, T = 2, 3, 16, 3 * kernel.CHUNK
    lengths = [1, 2, kernel.BLOCK_N + 1, kernel.CHUNK, kernel.CHUNK + 1, T]
    n = len(lengths)
    kc = torch.randn(n + 1, KV, T, D, generator=g).to(DEVICE, dtype)  # one slot past the rows
    vc = torch.randn(n + 1, KV, T, D, generator=g).to(DEVICE, dtype)
    q = torch.randn(n, KV, G, D, generator=g).to(DEVICE, dtype)
    k_new = torch.randn(n, KV, 1, D, generator=g).to(DEVICE, dtype)[:, :, 0]  # a strided view, as in the engine
    v_new = torch.randn(n, KV, 1, D, generator=g).to(DEVICE, dtype)[:, :, 0]
    want_k, want_v = kc.clone(), vc.clone()
    rows, pos = torch.arange(n, device=DEVICE), torch.tensor(lengths, device=DEVICE) - 1
    want_k[rows, :, pos], want_v[rows, :, pos] = k_new, v_new
    out = kernel.decode_attention(q, kc, vc, pos + 1, 1 / math.sqrt(D), T, new_kv=(k_new, v_new))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    if dtype == torch.float32 or DEVICE == "cuda":  # the interpreter's bf16 dots are not the GPU's
        torch.testing.assert_close(out.float(), _reference(q, want_k, want_v, lengths), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="new_kv"):
        kernel.decode_attention(q, kc, vc, pos + 1, 0.25, T, tokens=2, new_kv=(k_new, v_new))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_and_writes_an_8bit_cache(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """An 8-bit cache: tiles convert to q's dtype as they load, and the new K/V land as
    ``KVCache.encode`` stores them (NaN as 0, clamped to the format's range, rounded). Off the GPU the
    new values are ones the format holds exactly, plus out-of-range ones: triton's
    interpreter rounds some in-between values to a neighbour of the GPU's."""
    g = torch.Generator().manual_seed(5)
    KV, G, D, T = 2, 4, 32, 2 * kernel.CHUNK
    lengths = [1, 3, kernel.CHUNK, kernel.CHUNK + 1, T]
    n = len(lengths)
    kc = (2 * torch.randn(n + 1, KV, T, D, generator=g)).to(kv_dtype).to(DEVICE)
    vc = torch.randn(n + 1, KV, T, D, generator=g).to(kv_dtype).to(DEVICE)
    q = torch.randn(n, KV, G, D, generator=g).to(DEVICE, dtype)
    k_new, v_new = (4 * torch.randn(n, KV, D, generator=g) for _ in range(2))
    if DEVICE != "cuda":
        k_new, v_new = (x.to(kv_dtype).float() for x in (k_new, v_new))
    k_new[0, 0, :3] = torch.tensor([1e6, -1e6, 0.0])  # saturate, never overflow to NaN / inf
    nan_at = (0, 1, 5)
    k_new[nan_at] = v_new[nan_at] = float("nan")  # stored as 0, as KVCache.encode stores it
    k_new, v_new = k_new.to(DEVICE, dtype), v_new.to(DEVICE, dtype)
    top = torch.finfo(kv_dtype).max
    want_k, want_v = kc.clone(), vc.clone()
    rows, pos = torch.arange(n, device=DEVICE), torch.tensor(lengths, device=DEVICE) - 1
    want_k[rows, :, pos] = torch.nan_to_num(k_new, nan=0.0).clamp(-top, top).to(kv_dtype)
    want_v[rows, :, pos] = torch.nan_to_num(v_new, nan=0.0).clamp(-top, top).to(kv_dtype)
    out = kernel.decode_attention(q, kc, vc, pos + 1, 1 / math.sqrt(D), T, new_kv=(k_new, v_new))
    assert torch.equal(kc.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), want_v.view(torch.uint8))
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    if dtype == torch.float32 or DEVICE == "cuda":  # the interpreter's bf16 dots are not the GPU's
        torch.testing.assert_close(out.float(), _reference(q, want_k, want_v, lengths), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_and_writes_a_transposed_v_cache(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """V stored with its positions contiguous (``KVCache.positions_last``, how an 8-bit cache
    stores it): the kernel writes the new V where the position-major cache gets it and returns
    the same output, though it reads V unmasked up to the next BLOCK_N past each row (the
    values there, finite, take zero weight). A transposed cache whose positions are not padded
    to the launch's BLOCK_N is refused."""
    from miles.engines.kv_cache import positions_last

    g = torch.Generator().manual_seed(11)
    KV, G, D, T = 2, 3, 32, 2 * kernel.CHUNK + 5  # positions not a multiple of BLOCK_N
    lengths = [1, 2, kernel.BLOCK_N + 1, kernel.CHUNK, kernel.CHUNK + 1, T]
    n = len(lengths)
    kc = torch.randn(n + 1, KV, T, D, generator=g).to(DEVICE, kv_dtype)
    vc = (3 * torch.randn(n + 1, KV, T, D, generator=g)).to(DEVICE, kv_dtype)
    vt = positions_last(tuple(vc.shape), torch.device(DEVICE), kv_dtype).copy_(vc)
    assert vt.stride(-2) == 1 and torch.equal(vt.float(), vc.float())
    q = torch.randn(n, KV, G, D, generator=g).to(DEVICE, dtype)
    k_new, v_new = (torch.randn(n, KV, D, generator=g).to(kv_dtype).to(DEVICE, dtype) for _ in range(2))
    lens = torch.tensor(lengths, device=DEVICE)
    kc2 = kc.clone()
    want = kernel.decode_attention(q, kc, vc, lens, 1 / math.sqrt(D), T, new_kv=(k_new, v_new))
    out = kernel.decode_attention(q, kc2, vt, lens, 1 / math.sqrt(D), T, new_kv=(k_new, v_new))
    bits = torch.uint8 if kv_dtype != torch.float32 else torch.int32
    assert torch.equal(vt.view(bits), vc.view(bits)) and torch.equal(kc2.view(bits), kc.view(bits))
    if dtype == torch.float32 or DEVICE == "cuda":  # the interpreter's bf16 dots are not the GPU's
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(out.float(), _reference(q, kc, vc, lengths), atol=max(tol, 2e-5), rtol=tol)
        # a verify step's form (two new tokens a row, already written): the same on both layouts
        q2 = torch.randn(n, KV, 2 * G, D, generator=g).to(DEVICE, dtype)
        lens2 = lens.clamp(min=2)
        torch.testing.assert_close(kernel.decode_attention(q2, kc, vt, lens2, 0.2, T, tokens=2).float(),
                                   kernel.decode_attention(q2, kc, vc, lens2, 0.2, T, tokens=2).float(),
                                   atol=tol, rtol=tol)
    store = torch.zeros(n + 1, KV, D, T, device=DEVICE, dtype=kv_dtype)  # positions unpadded
    with pytest.raises(ValueError, match="padded to a multiple"):
        kernel.decode_attention(q, kc, store.transpose(-1, -2), lens, 1 / math.sqrt(D), T)
    with pytest.raises(ValueError, match="contiguous head dim"):
        kernel.decode_attention(q, kc.transpose(-1, -2).contiguous().transpose(-1, -2), vc, lens, 0.2, T)


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 and fp16 dots on the GPU")
def test_float16_dots_over_an_8bit_cache_are_as_close_as_bfloat16_ones() -> None:
    """``F16_DOTS``: over an fp8 cache (V transposed, as KVCache stores it) with bfloat16 q, the
    float16 dots land at least as close to a float32 softmax over the same 8-bit values as the
    bfloat16 dots do (P keeps 3 more bits), at the engine's shape and launch."""
    from miles.engines.kv_cache import positions_last

    g = torch.Generator().manual_seed(8)
    n, KV, G, D, T = 64, 8, 2, 128, 1100
    fp8 = torch.float8_e4m3fn
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    kc = (2 * torch.randn(n, KV, T, D, generator=g)).to(fp8).cuda()
    vc = torch.randn(n, KV, T, D, generator=g).to(fp8).cuda()
    vt = positions_last(tuple(vc.shape), torch.device("cuda"), fp8).copy_(vc)
    q = torch.randn(n, KV, G, D, generator=g).cuda().bfloat16()
    ref = _reference(q, kc, vc, lengths.tolist())
    errs = {f16: (kernel.decode_attention(q, kc, vt, lengths.cuda(), D ** -0.5, T, f16_dots=f16).float() - ref)
            .abs().max().item() for f16 in (True, False)}
    assert errs[True] <= errs[False] and errs[True] < 2e-2, errs


@pytest.mark.skipif(DEVICE != "cuda", reason="triton's interpreter rounds some values into float8 unlike the GPU")
def test_engine_with_triton_decode_on_an_fp8_cache_matches_matmul() -> None:
    """The kernel's 8-bit cache writes and reads are the torch path's: the same tokens."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 250, (m,), generator=g).tolist() for m in (3, 9, 270, 17)]
    ref, _ = _generate("matmul", prompts, decode_split=False, kv_cache_dtype="fp8_e4m3")
    out, _ = _generate("triton", prompts, kv_cache_dtype="fp8_e4m3")
    for a, b in zip(ref, out):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 numerics on the GPU")
def test_kernel_bf16_close_to_float32_reference() -> None:
    g = torch.Generator().manual_seed(1)
    n, KV, G, D, T = 64, 8, 2, 128, 2048
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    kc = torch.randn(n, KV, T, D, generator=g).to(DEVICE, torch.bfloat16)
    vc = torch.randn(n, KV, T, D, generator=g).to(DEVICE, torch.bfloat16)
    q = torch.randn(n, KV, G, D, generator=g).to(DEVICE, torch.bfloat16)
    out = kernel.decode_attention(q, kc, vc, lengths.to(DEVICE), 1 / math.sqrt(D), T)
    ref = _reference(q, kc, vc, lengths.tolist())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def _generate(decode_attention: str, prompts: list[list[int]], qk_norm: bool = True, **kw) -> list:
    torch.manual_seed(0)
    model = CausalLM(tiny_config(initializer_range=0.1, qk_norm=qk_norm)).eval()
    cfg = EngineConfig(max_batch_size=4, max_seq_len=300, device=DEVICE, dtype="float32",
                       decode_attention=decode_attention, **kw)
    engine = EmbeddedEngine(model, config=cfg)
    sp = SamplingParams(max_new_tokens=12, seed=5, ignore_eos=True)

    async def go():
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(rid=str(i), input_ids=p, sampling=sp))
                                      for i, p in enumerate(prompts)))
        useful = engine.runner.kv_useful / max(engine.runner.kv_read, 1)
        await engine.close()
        return outs, useful

    return asyncio.run(go())


def test_engine_with_triton_decode_matches_matmul_engine() -> None:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 250, (m,), generator=g).tolist() for m in (3, 9, 270, 17)]
    ref, ref_useful = _generate("matmul", prompts, decode_split=False)
    out, useful = _generate("triton", prompts)
    for a, b in zip(ref, out):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs),
                                   atol=1e-5, rtol=0)
    assert useful == 1.0 and ref_useful < 0.5  # one long row pads the matmul engine's reads


@pytest.mark.parametrize("qk_norm", [True, False])
def test_engine_with_rope_in_the_kernel_matches_rope_outside(qk_norm: bool) -> None:
    """``decode_fuse_rope`` (the default) against the compiled layer functions applying the
    q/k-norms and RoPE: the same tokens and log-probs (float32), Qwen3 and Llama shapes."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 250, (m,), generator=g).tolist() for m in (3, 9, 270, 17)]
    ref, _ = _generate("triton", prompts, decode_fuse_rope=False, qk_norm=qk_norm)
    out, _ = _generate("triton", prompts, qk_norm=qk_norm)
    for a, b in zip(ref, out):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)


def test_length_aware_decode_needs_one_graph_per_batch_bucket() -> None:
    """The kernel reads each row only to its length, so decode passes the whole cache length
    and the CUDA graphs (replayed eagerly here) are keyed by batch bucket alone."""
    from .test_graph_plumbing import _fake_graphs

    torch.manual_seed(0)
    model = CausalLM(tiny_config(initializer_range=0.1)).eval()
    engine = EmbeddedEngine(model, config=EngineConfig(max_batch_size=4, max_seq_len=300, device=DEVICE,
                                                       dtype="float32", decode_attention="triton", kv_block=16))
    graphs = _fake_graphs(engine)
    g = torch.Generator().manual_seed(4)
    sp = [SamplingParams(max_new_tokens=m, seed=i, ignore_eos=True) for i, m in enumerate((6, 20, 12, 3, 9))]
    prompts = [torch.randint(5, 250, (m,), generator=g).tolist() for m in (3, 40, 200, 17, 90)]

    async def go():
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(rid=str(i), input_ids=p, sampling=s))
                                      for i, (p, s) in enumerate(zip(prompts, sp))))
        await engine.close()
        return outs

    outs = asyncio.run(go())
    assert [len(o.output_ids) for o in outs] == [s.max_new_tokens for s in sp]
    assert len({nb for nb, _ in graphs.graphs}) > 1  # several batch sizes ...
    assert {L for _, L in graphs.graphs} == {engine.runner.cache.length}  # ... and one context for all


@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_speculative_engine_with_triton_matches_matmul(kind: str) -> None:
    """Verify steps and draft steps through the kernel: the same tokens as the matmul engine."""
    from .spec_helpers import generate_all, make_model, spec_engine

    policy = make_model()
    g = torch.Generator().manual_seed(3)
    requests = [GenerateRequest(rid=str(i), input_ids=torch.randint(5, 250, (m,), generator=g).tolist(),
                                sampling=SamplingParams(max_new_tokens=10, seed=i, ignore_eos=True))
                for i, m in enumerate((4, 30, 120))]
    outs = {}
    for attention in ("matmul", "triton"):
        engine = spec_engine(policy, kind, k=3, device=DEVICE, dtype="float32", decode_attention=attention,
                             decode_split=False)
        outs[attention] = generate_all(engine, requests)
        assert engine.stepper.stats.counters["spec_rounds"] > 0
    for a, b in zip(outs["matmul"], outs["triton"]):
        assert a.output_ids == b.output_ids and a.spec_accepted_tokens == b.spec_accepted_tokens
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)


def test_engine_config_rejects_triton_where_it_cannot_run() -> None:
    model = CausalLM(tiny_config(head_dim=8, hidden_size=32)).eval()
    with pytest.raises(ValueError, match="head_dim >= 16, got 8"):
        EmbeddedEngine(model, config=EngineConfig(device=DEVICE, decode_attention="triton", max_seq_len=64))


def test_a_kernel_that_fails_its_probe_is_not_used_by_auto(monkeypatch) -> None:
    """Where the kernel cannot compile or run, "auto" picks torch's attention and an explicit
    "triton" is refused with the kernel's own error."""
    def broken(*args, **kwargs):
        raise RuntimeError("no bf16 dot on this GPU")

    monkeypatch.setattr(kernel, "decode_attention", broken)
    kernel._launch_failure.cache_clear()
    try:
        reason = kernel.failure(DEVICE, torch.float32, 16)
        assert reason == "failed to run: RuntimeError: no bf16 dot on this GPU"
        if DEVICE == "cuda":
            assert EngineConfig(device=DEVICE).attention_mode(16) == "sdpa"
        with pytest.raises(ValueError, match="the kernel failed to run: RuntimeError: no bf16 dot"):
            EngineConfig(device=DEVICE, decode_attention="triton").validate(4096, 16)
    finally:
        kernel._launch_failure.cache_clear()
