"""Low-precision GEMMs on CUDA for ``miles.models.quant.QuantLinear``.

- FP8 (W8A8): activations quantized per 1 × 128 group, weights per 128 × 128 block. For up to
  256 rows (decode) ``fp8_config`` picks per (shape, batch bucket) one of: the Triton
  block-scaled GEMM quantizing its activation tiles itself (``fused``; measured slower than the
  unfused forms, so never the default), the Triton activation
  kernel then that GEMM (``triton``), or the Triton activation kernel then cuBLAS's block-wise
  ``torch._scaled_mm`` (``cublas``, also every larger M: prefill, the trainer). The
  ``_scaled_mm`` forms are probed once, on operands whose scales differ by orders of magnitude
  from one group and block to the next, and the first that matches the dequantized product is
  kept; where none does (``FP8_ERRORS`` records why; benchmarks/log/low_precision.md), the same
  quantized operands are multiplied dequantized (the quantizer's semantics, slowly). Every path
  quantizes the activations with the quantizer's arithmetic (bit-identical values), so the
  paths differ only in float32 summation order. ``FP8_PATH`` says which ran per shape and M.
- INT4 (W4A16): up to ``SMALL_M`` rows, the launch ``TUNED`` names per shape and batch bucket:
  a word-wise kernel (``lowp_triton.w4a16_gemv`` on the CUDA cores, ``w4a16_dott`` on the tensor
  cores, the packed weight read as int32 words, viewed, not copied), the byte-wise decode
  kernel (``lowp_triton.w4a16``: the packed weight streamed once, group scales applied after
  each group's float32 sum) or the tiled GEMM; above,
  a tiled Triton GEMM that dequantizes a tile in registers and accumulates in float32, split-K
  over a few programs when the output alone gives too few. Both deterministic (partial sums
  added in a fixed order) and equal to the dequantized product to bf16 round-off.

Launch parameters come from ``TUNED`` per (kind, N, K, batch bucket): defaults measured on a
Hopper GPU, overridden by ``benchmarks/low_precision.py --parts tune``, which times a few launches per
shape and keeps the fastest that matches the dequantized product.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

FP8_PATH: dict[str, str] = {}  # per "NxK/M" seen: the Triton GEMM, the _scaled_mm form used, or "dequantized"
INT4_PATH: dict[str, str] = {}  # per "NxK/M" seen on CUDA: the decode kernel's launch or "tiled"
FP8_ERRORS: dict[str, str] = {}  # why each _scaled_mm form was refused (the first probe's messages)
INT4_CONFIG: dict[str, int] = {}  # overrides of the large-M INT4 launch (BN, warps, stages, programs), for tuning
# Launches of the decode-sized kernels per (kind, N, K, M bucket): the defaults measured on a
# Hopper GPU (benchmarks/log/low_precision.md), which ``benchmarks/low_precision.py --parts tune`` overrides.
BUCKETS = (1, 16, 64, 256)  # a batch takes the launch of the first bucket at or above it
_CUBLAS = dict(path="cublas")
_TILED = dict(path="tiled", BN=64, programs=264, warps=4, stages=3)
TUNED: dict[tuple[str, int, int, int], dict] = {
    # Qwen3-8B's decode GEMMs (qkv, o, gate/up, down): the fastest checked launch of
    # `low_precision.py --parts tune` (its raw section in benchmarks/log/low_precision.md)
    ("int4", 24576, 4096, 1): {"path": "gemv", "BN": 16, "U": 8, "split": 0, "programs": 1056, "warps": 4, "stages": 2},
    ("fp8", 24576, 4096, 1): {"path": "triton", "BM": 16, "BN": 64, "warps": 4, "stages": 4},
    ("int4", 24576, 4096, 16): {"path": "tiled", "BN": 64, "programs": 264, "warps": 4, "stages": 3},
    ("fp8", 24576, 4096, 16): {"path": "triton", "BM": 16, "BN": 64, "warps": 4, "stages": 4},
    ("fp8", 24576, 4096, 64): {"path": "triton", "BM": 64, "BN": 64, "warps": 4, "stages": 4},
    ("fp8", 24576, 4096, 256): {"path": "cublas"},
    ("int4", 4096, 12288, 1): {"path": "gemv", "BN": 16, "U": 8, "split": 0, "programs": 1056, "warps": 4, "stages": 2},
    ("fp8", 4096, 12288, 1): {"path": "triton", "BM": 16, "BN": 32, "warps": 4, "stages": 4, "split": 3},
    ("int4", 4096, 12288, 16): {"path": "dott", "BN": 64, "BM": 16, "U": 2, "split": 0, "programs": 1056, "warps": 4, "stages": 2, "JOIN": True, "NIB16": 1},
    ("fp8", 4096, 12288, 16): {"path": "cublas"},
    ("fp8", 4096, 12288, 64): {"path": "triton", "BM": 64, "BN": 64, "warps": 4, "stages": 4, "split": 2},
    ("fp8", 4096, 12288, 256): {"path": "cublas"},
    ("int4", 6144, 4096, 1): {"path": "gemv", "BN": 16, "U": 8, "split": 0, "programs": 528, "warps": 4, "stages": 2, "PF": True, "INPLACE": True, "RED": True},
    ("fp8", 6144, 4096, 1): {"path": "triton", "BM": 16, "BN": 32, "warps": 4, "stages": 4, "split": 3},
    ("int4", 6144, 4096, 16): {"path": "dott", "BN": 64, "BM": 16, "U": 2, "split": 0, "programs": 528, "warps": 4, "stages": 2, "JOIN": True, "NIB16": 0},
    ("fp8", 6144, 4096, 16): {"path": "triton", "BM": 16, "BN": 32, "warps": 4, "stages": 4, "split": 3},
    ("fp8", 6144, 4096, 64): {"path": "cublas"},
    ("fp8", 6144, 4096, 256): {"path": "cublas"},
    ("int4", 4096, 4096, 1): {"path": "gemv", "BN": 16, "U": 8, "split": 0, "programs": 1056, "warps": 4, "stages": 2},
    ("fp8", 4096, 4096, 1): {"path": "triton", "BM": 16, "BN": 32, "warps": 4, "stages": 4, "split": 3},
    ("int4", 4096, 4096, 16): {"path": "dott", "BN": 64, "BM": 16, "U": 2, "split": 0, "programs": 528, "warps": 4, "stages": 2, "JOIN": True, "NIB16": 0},
    ("fp8", 4096, 4096, 16): {"path": "triton", "BM": 16, "BN": 32, "warps": 4, "stages": 4, "split": 3},
    ("fp8", 4096, 4096, 64): {"path": "triton", "BM": 64, "BN": 64, "warps": 4, "stages": 4, "split": 2},
    ("fp8", 4096, 4096, 256): {"path": "cublas"},
}
SMALL_M = 16  # the W4A16 decode kernel's rows at most; more go to the tiled GEMM
_FORM: list[str | None] = []  # the _scaled_mm form the first probe validated, or None


ROWS = 16  # the block-wise GEMM's rows are padded to a multiple of this (cuBLAS refuses some row counts)
K_BLOCKS = 4  # cuBLAS takes block-wise scales over a multiple of 4 blocks of K; other K run dequantized


def _outer_major(t: Tensor) -> Tensor:
    """``t`` with strides (1, rows): the outer dimension fastest, as cuBLAS's block-wise scales
    are laid out (``t`` itself where it already is). Built explicitly: ``t.t().contiguous().t()``
    keeps a one-row tensor's strides."""
    if t.shape[0] > 1 and t.stride() == (1, t.shape[0]):
        return t
    out = torch.empty_strided(t.shape, (1, t.shape[0]), dtype=t.dtype, device=t.device)
    return out.copy_(t)


@functools.cache
def _mm_forms() -> dict[str, object]:
    """Ways to ask for the 1x128 / 128x128 block-wise recipe across torch versions: the
    private and the public API, each scale outer-major or row-major."""
    a_layouts = {"a_outer": _outer_major, "a_rows": lambda t: t.contiguous()}
    b_layouts = {"b_view": lambda w: w.t(), "b_contig": lambda w: w.t().contiguous()}
    forms: dict[str, object] = {}
    for an, fa in a_layouts.items():
        for bn, fb in b_layouts.items():
            forms[f"scaled_mm/{an}/{bn}"] = (lambda fa, fb: lambda xq, xs, wq, ws, dt: torch._scaled_mm(
                xq, wq.t(), scale_a=fa(xs), scale_b=fb(ws), out_dtype=dt))(fa, fb)
            if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
                st = F.ScalingType
                forms[f"F.scaled_mm/{an}/{bn}"] = (lambda fa, fb: lambda xq, xs, wq, ws, dt: F.scaled_mm(
                    xq, wq.t(), scale_a=fa(xs), scale_recipe_a=st.BlockWise1x128,
                    scale_b=fb(ws), scale_recipe_b=st.BlockWise128x128, output_dtype=dt))(fa, fb)
    return forms


def _probe(device: torch.device, dt: torch.dtype) -> str | None:
    """The first form that runs and matches the dequantized product (None: none does), on
    operands made for the check: every activation group and weight block scaled apart (over
    four orders of magnitude), so a form that reads a scale of the wrong row, group or block
    misses by far more than FP8's round-off, where real operands, whose scales are close,
    could hide it; rows and columns not square, so a transposed layout cannot pass either."""
    from miles.kernels.quantize import BLOCK, fp8_dequantize_weight, fp8_quantize_act, fp8_quantize_weight

    g = torch.Generator(device="cpu").manual_seed(0)
    M, K, N = 2 * ROWS, K_BLOCKS * BLOCK, 2 * BLOCK

    def spread(rows: int, groups_r: int, groups_c: int) -> Tensor:
        f = torch.exp(torch.randn(groups_r, groups_c, generator=g) * 2.5)
        return f.repeat_interleave(rows // groups_r, 0).repeat_interleave(BLOCK, 1)

    x = (torch.randn(M, K, generator=g) * spread(M, M, K // BLOCK)).to(device)
    w = (torch.randn(N, K, generator=g) * spread(N, N // BLOCK, K // BLOCK)).to(device)
    xq, xs = fp8_quantize_act(x)
    wq, ws = fp8_quantize_weight(w)
    ref = F.linear(xq.float() * xs.repeat_interleave(BLOCK, -1), fp8_dequantize_weight(wq, ws))
    for name, fn in _mm_forms().items():
        try:
            y = fn(xq, xs, wq, ws, dt).float()
        except Exception as exc:  # noqa: BLE001 - each refusal is recorded, the next form tried
            FP8_ERRORS[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        err = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
        if err < 1e-2:
            return name
        FP8_ERRORS[name] = f"ran, relative error {err:.3g} against the dequantized product"
    return None


def linear(x: Tensor, stored: tuple[Tensor, ...], spec, bias: Tensor | None = None) -> Tensor:  # noqa: ANN001
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if spec.kind == "fp8":
        y = fp8_linear(flat, stored[0], stored[1], x.dtype)
    else:
        y = int4_linear(flat, stored[0], stored[1], spec.group_size)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], y.shape[-1])


def fp8_linear(x: Tensor, wq: Tensor, ws: Tensor, out_dtype: torch.dtype) -> Tensor:
    from miles.kernels.quantize import BLOCK, fp8_dequantize_weight, fp8_quantize_act

    N, K = wq.shape
    M = x.shape[0]
    key = f"{N}x{K}/{M}"
    cfg = fp8_config(M, N, K) if x.is_cuda and _triton() is not None else None
    if cfg is not None and cfg["path"] != "cublas":
        FP8_PATH[key] = _label(cfg)
        return _fp8_triton(x, wq, ws, out_dtype, cfg)
    if K % (K_BLOCKS * BLOCK) == 0 and N % BLOCK == 0:
        if not _FORM:  # probed once, outside any graph capture (the first call)
            _FORM.append(_probe(x.device, out_dtype))
        if _FORM[0] is None and cfg is not None and M <= BUCKETS[-1]:  # no block-wise cuBLAS: the Triton GEMM
            tri = dict(path="triton", BM=16 if M <= 16 else 64, BN=64 if M <= 16 else 128, warps=4, stages=3)
            FP8_PATH[key] = _label(tri)
            return _fp8_triton(x, wq, ws, out_dtype, tri)
        if _FORM[0] is not None:
            pad = -M % ROWS
            if cfg is not None:  # the activations quantized by one Triton kernel, scales laid out for cuBLAS
                xq, xs = _fp8_quant_triton(x, M + pad, outer="a_outer" in _FORM[0])
            else:
                xq, xs = fp8_quantize_act(F.pad(x, (0, 0, 0, pad)) if pad else x)
            FP8_PATH[key] = _FORM[0]
            y = _mm_forms()[_FORM[0]](xq, xs, wq, ws, out_dtype)
            return y[:M] if pad else y
    xq, xs = fp8_quantize_act(x)
    FP8_PATH[key] = "dequantized"
    xd = (xq.float() * xs.repeat_interleave(BLOCK, -1)[:, :K]).to(out_dtype)
    return F.linear(xd, fp8_dequantize_weight(wq, ws, out_dtype))


def int4_linear(x: Tensor, packed: Tensor, scale: Tensor, group: int) -> Tensor:
    """``x [M, K] @ dequant(W)ᵀ``: Triton on CUDA, dequantize-and-matmul elsewhere."""
    if not x.is_cuda:
        from miles.kernels.quantize import int4_dequantize, unpack_int4

        return F.linear(x, int4_dequantize(unpack_int4(packed), scale, x.dtype))
    cfg = int4_config(x.shape[0], packed.shape[0], x.shape[1], group, x.dtype)
    INT4_PATH[f"{packed.shape[0]}x{x.shape[1]}/{x.shape[0]}"] = "tiled" if cfg is None else _label(cfg)
    if cfg is not None and cfg.get("path") == "tiled":
        return _int4_triton(x, packed, scale, group, cfg)
    if cfg is not None and cfg.get("path") in ("gemv", "dott"):
        return _int4_words(x, packed, scale, group, cfg)
    if cfg is not None:
        return _int4_small(x, packed, scale, group, cfg)
    return _int4_triton(x, packed, scale, group)


def _label(cfg: dict) -> str:
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in cfg.items())


def _int4_triton(x: Tensor, packed: Tensor, scale: Tensor, group: int, launch: dict | None = None) -> Tensor:
    import triton

    launch = INT4_CONFIG if launch is None else launch
    M, K = x.shape
    N = packed.shape[0]
    BK = 128 if group % 128 == 0 else 64 if group % 64 == 0 else 32
    if group % BK or K % BK:
        raise ValueError(f"the INT4 kernel needs the group size ({group}) and K ({K}) to be multiples of 32")
    BM = 16 if M <= 16 else 32 if M <= 32 else 64
    BN = launch.get("BN", 64 if M <= 64 else 128)
    grid_m, grid_n = triton.cdiv(M, BM), triton.cdiv(N, BN)
    tiles = K // BK
    split = max(1, min(tiles, launch.get("programs", 264) // (grid_m * grid_n)))
    while tiles % split:
        split -= 1
    x = x.contiguous()
    part = torch.empty((split, M, N), device=x.device, dtype=torch.float32 if split > 1 else x.dtype)
    _kernel()[(grid_m, grid_n, split)](
        x, packed, scale, part, M, N, K, group, tiles // split,
        x.stride(0), packed.stride(0), scale.stride(0), M * N, N,
        BM=BM, BN=BN, BK=BK, num_warps=launch.get("warps", 4), num_stages=launch.get("stages", 3),
    )
    return part[0] if split == 1 else part.sum(0).to(x.dtype)


def _triton():  # noqa: ANN202
    from miles.kernels import lowp_triton

    return lowp_triton.triton


def _bucket(M: int) -> int | None:
    return next((b for b in BUCKETS if M <= b), None)


def int4_config(M: int, N: int, K: int, group: int, dtype: torch.dtype) -> dict | None:
    """The decode kernel's launch for ``M`` rows (None: the tiled GEMM). Its tiles are one
    quantization group wide, so the group must be a power of two from 32 (``tl.dot``'s K ≥ 16)."""
    if M > SMALL_M or group < 32 or group & (group - 1) or K % group or _triton() is None:
        return None
    cfg = TUNED.get(("int4", N, K, _bucket(M)), _TILED)  # untuned shapes: the tiled GEMM (the best at most tuned ones)
    if cfg.get("path") in ("tiled", "gemv", "dott"):
        return cfg
    if cfg["DOT"] and dtype not in (torch.bfloat16, torch.float16):  # a float32 tl.dot would round to tf32
        cfg = {**cfg, "DOT": False, "BN": min(cfg["BN"], 16)}
    return cfg


def _int4_small(x: Tensor, packed: Tensor, scale: Tensor, group: int, cfg: dict) -> Tensor:
    import triton

    from miles.kernels import lowp_triton as lt

    M, K = x.shape
    N = packed.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    dot = cfg["DOT"] and x.dtype in (torch.bfloat16, torch.float16)  # a float32 tl.dot would round to tf32
    BM = 16 if dot else max(1, 1 << (M - 1).bit_length())
    groups = K // group
    unroll = cfg["UNROLL"]
    while groups % unroll:
        unroll //= 2
    tiles = triton.cdiv(N, cfg["BN"]) * triton.cdiv(M, BM)
    # split 0: enough K slices for ~2048 programs (16 resident on each of a Hopper GPU's 132 SMs):
    # a GEMV's speed is the bytes in flight, and one program's K loop is a chain of loads
    split = cfg["split"] or max(1, min(8, 2048 // tiles))
    while (groups // unroll) % split:
        split -= 1
    grid = (triton.cdiv(N, cfg["BN"]), split, triton.cdiv(M, BM))
    out = torch.empty((split, M, N) if split > 1 else (M, N), device=x.device,
                      dtype=torch.float32 if split > 1 else x.dtype)
    lt.w4a16[grid](x, packed, scale, out, M, N, K // split, x.stride(0), packed.stride(0), scale.stride(0), M * N, N,
                   G=group, BM=BM, BN=cfg["BN"], UNROLL=unroll, DOT=dot, MAGIC=cfg.get("MAGIC", True),
                   ACC2D=cfg.get("ACC2D", False),
                   KIND=0 if not dot else 1 if x.dtype == torch.bfloat16 else 2,
                   num_warps=cfg["warps"], num_stages=cfg["stages"])
    if split == 1:
        return out
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    lt.sum_splits[(triton.cdiv(M * N, 1024),)](out, y, M * N, SPLIT=split, BLOCK=1024)
    return y


def _int4_words(x: Tensor, packed: Tensor, scale: Tensor, group: int, cfg: dict) -> Tensor:
    """The word-wise W4A16 kernels (``lowp_triton.w4a16_gemv`` / ``w4a16_dott``): ``cfg`` gives
    the path, ``BN`` rows a program, ``U`` groups a loop step, and ``split`` K slices (0: as
    many as bring the programs up to ``programs``), ``warps`` and ``stages``; optionally ``PF``
    (the next step's words loaded by hand before this step's arithmetic; one group a step in
    ``dott``), ``INPLACE`` (gemv: nibbles read in place, ``lowp_triton._plane_at``) and, for
    ``dott``, ``JOIN``, ``NIB16`` (0, 1 or 2: ``lowp_triton._half``) and ``SWAP`` (with JOIN:
    the weights the dot's second operand); ``RED``: split-K's partials added by the last program
    of each tile (``lowp_triton._last_adds``) instead of a second launch, the same bits; ``XP``
    (gemv): the activations copied plane-major first (one small launch)."""
    import triton

    from miles.kernels import lowp_triton as lt

    M, K = x.shape
    N = packed.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    words = packed.view(torch.int32)  # [N, K/8]: eight nibbles, the columns 8w .. 8w + 7
    dot = cfg["path"] == "dott" and x.dtype in (torch.bfloat16, torch.float16)  # no tf32 dot
    BN, BM = cfg["BN"], (cfg.get("BM", 16) if dot else 1)
    groups = K // group
    pf = bool(cfg.get("PF", False))
    unroll = 1 if pf and dot else cfg["U"]  # the tensor-core kernel prefetches one group a step
    while groups % unroll:
        unroll //= 2
    tiles = triton.cdiv(N, BN) * triton.cdiv(M, BM)
    split = cfg.get("split", 0) or max(1, min(groups // unroll, cfg.get("programs", 1056) // tiles))
    while (groups // unroll) % split:
        split -= 1
    grid = (triton.cdiv(N, BN), split, triton.cdiv(M, BM))
    out = torch.empty((split, M, N) if split > 1 else (M, N), device=x.device,
                      dtype=torch.float32 if split > 1 else x.dtype)
    kw_per = K // 8 // split
    launch = dict(num_warps=cfg["warps"], num_stages=cfg.get("stages", 2))
    red = split > 1 and bool(cfg.get("RED", False)) and grid[0] * grid[2] <= _COUNTS and (
        x.device in _COUNTERS or not (x.is_cuda and torch.cuda.is_current_stream_capturing()))
    y = torch.empty((M, N), device=x.device, dtype=x.dtype) if red else None
    if red:
        launch.update(out_ptr=y, cnt_ptr=_counters(x.device), RED=True)
    if dot:
        lt.w4a16_dott[grid](x, words, scale, out, M, N, kw_per, x.stride(0), words.stride(0), scale.stride(0),
                            M * N, N, G=group, BN=BN, BM=BM, U=unroll,
                            KIND=1 if x.dtype == torch.bfloat16 else 2, JOIN=cfg.get("JOIN", False),
                            NIB16=int(cfg.get("NIB16", 0)), PF=pf,
                            SWAP=bool(cfg.get("SWAP", False)) and bool(cfg.get("JOIN", False)), **launch)
    else:
        # XP: x copied plane-major, [M, 8, K/8] (column 8w + i at i·K/8 + w), so a plane's loads are
        # contiguous instead of 16 bytes apart
        xp = x.view(M, K // 8, 8).transpose(1, 2).contiguous() if cfg.get("XP") else None
        sx = (K, 1, K // 8) if xp is not None else (x.stride(0), 8, 1)
        lt.w4a16_gemv[grid](x if xp is None else xp, words, scale, out, N, kw_per, *sx, words.stride(0),
                            scale.stride(0), M * N, N, G=group, BN=BN, U=unroll, PF=pf,
                            INPLACE=bool(cfg.get("INPLACE", False)), **launch)
    if split == 1:
        return out
    if red:
        return y
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    lt.sum_splits[(triton.cdiv(M * N, 1024),)](out, y, M * N, SPLIT=split, BLOCK=1024)
    return y


_COUNTS = 1 << 16  # tiles a split-K launch may reduce in place (``RED``): one int32 counter each
_COUNTERS: dict[torch.device, Tensor] = {}


def _counters(device: torch.device) -> Tensor:
    """The per-tile counters of the in-kernel split-K sum (``lowp_triton._last_adds``): zero
    between launches (the last program of each tile puts its counter back), so one buffer per
    device serves every launch on a stream. Made on the first call outside a graph capture (a
    capture's own zeros would be written only when the graph replays)."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(_COUNTS, device=device, dtype=torch.int32)
    return _COUNTERS[device]


def fp8_config(M: int, N: int, K: int) -> dict:
    """The FP8 GEMM for ``M`` rows: ``path`` cublas (the activations quantized by one Triton
    kernel, then block-wise ``_scaled_mm``), triton (that kernel, then the Triton block-scaled
    GEMM) or fused (the GEMM quantizing its activation tiles itself), with its tile launch."""
    b = _bucket(M)
    if b is None:
        return dict(path="cublas")
    return TUNED.get(("fp8", N, K, b), _CUBLAS)


def _fp8_quant_triton(x: Tensor, rows: int, outer: bool) -> tuple[Tensor, Tensor]:
    """``quantize.fp8_quantize_act`` of ``x`` [M, K] in one kernel, into ``rows`` ≥ M rows (the
    rows past M zero groups); scales outer-major (cuBLAS's block-wise layout) or row-major."""
    import triton

    from miles.kernels import lowp_triton as lt
    from miles.kernels.quantize import BLOCK, FP8, FP8_MAX

    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    G = triton.cdiv(K, BLOCK)
    xq = torch.empty((rows, K), device=x.device, dtype=FP8)
    xs = (torch.empty_strided((rows, G), (1, rows), device=x.device, dtype=torch.float32) if outer
          else torch.empty((rows, G), device=x.device, dtype=torch.float32))
    BR = 16
    lt.fp8_act_quant[(triton.cdiv(rows, BR), G)](x, xq, xs, M, rows, K, x.stride(0), xq.stride(0), xs.stride(0),
                                                 xs.stride(1), BR=BR, GB=BLOCK, FP8_MAX=FP8_MAX, num_warps=4)
    return xq, xs


def _fp8_triton(x: Tensor, wq: Tensor, ws: Tensor, out_dtype: torch.dtype, cfg: dict) -> Tensor:
    import triton

    from miles.kernels import lowp_triton as lt
    from miles.kernels.quantize import BLOCK, FP8_MAX

    M, K = x.shape
    N = wq.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    fused = cfg["path"] == "fused"
    if fused:
        xq, xs = x, ws  # unused operands of the fused form
    else:
        xq, xs = _fp8_quant_triton(x, M, outer=False)
    blocks = triton.cdiv(K, BLOCK)
    split = max(1, min(cfg.get("split", 1), blocks))
    k_per = triton.cdiv(blocks, split) * BLOCK
    split = triton.cdiv(K, k_per)
    y = torch.empty((split, M, N) if split > 1 else (M, N), device=x.device,
                    dtype=torch.float32 if split > 1 else out_dtype)
    grid = (triton.cdiv(M, cfg["BM"]), triton.cdiv(N, cfg["BN"]), split)
    lt.fp8_gemm[grid](x, xq, xs, wq, ws, y, M, N, K, k_per, x.stride(0), xq.stride(0), xs.stride(0), xs.stride(1),
                      wq.stride(0), ws.stride(0), ws.stride(1), N, M * N,
                      BM=cfg["BM"], BN=cfg["BN"], BK=BLOCK, FUSED=fused, FP8_MAX=FP8_MAX,
                      num_warps=cfg["warps"], num_stages=cfg["stages"])
    if split == 1:
        return y
    out = torch.empty((M, N), device=x.device, dtype=out_dtype)
    lt.sum_splits[(triton.cdiv(M * N, 1024),)](y, out, M * N, SPLIT=split, BLOCK=1024)
    return out


_KERNEL = None


def _kernel():  # noqa: ANN202
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def int4_gemm(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, G, tiles_per, sxm, swn, ssn, sys_, sym,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        rk2 = tl.arange(0, BK // 2)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for t in range(pid_k * tiles_per, (pid_k + 1) * tiles_per):
            k0 = t * BK
            x = tl.load(x_ptr + rm[:, None] * sxm + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            p = tl.load(w_ptr + rn[:, None] * swn + (k0 // 2 + rk2)[None, :], mask=rn[:, None] < N, other=0)
            lo = (p & 0xF).to(tl.int32) - 8
            hi = (p >> 4).to(tl.int32) - 8
            w = tl.reshape(tl.join(lo, hi), (BN, BK))
            s = tl.load(s_ptr + rn * ssn + k0 // G, mask=rn < N, other=0.0)
            w = (w.to(tl.float32) * s[:, None]).to(x.dtype)
            acc += tl.dot(x, tl.trans(w))
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(y_ptr + pid_k * sys_ + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)

    _KERNEL = int4_gemm
    return _KERNEL
