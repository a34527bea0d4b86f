"""The gate/up GEMM with SiLU·up in one Triton kernel (``miles.kernels.gate_up``) against
torch's GEMMs: float32 on the CPU interpreter (tests/conftest.py sets TRITON_INTERPRET), and
bf16 at a Qwen3-0.6B MLP's shapes on CUDA; the engine uses it only on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles.kernels import gate_up as kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not kernel.available(DEVICE),
                                  reason="needs triton (CUDA, or its CPU interpreter with numpy < 2.4)")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up


@needs_triton
@pytest.mark.parametrize("M,K,I", [(1, 256, 128), (5, 96, 80), (70, 100, 50)])
@pytest.mark.parametrize("launch", [(16, 32, 64, 4, 2), (64, 64, 64, 4, 2)])
def test_float32_matches_torch_with_and_without_tails(M: int, K: int, I: int, launch: tuple) -> None:
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).to(DEVICE)
    w = (torch.randn(2 * I, K, generator=g) / 16).to(DEVICE)
    out = kernel.gate_up_silu(x, w, launch)
    assert out.shape == (M, I) and out.dtype == torch.float32
    assert (out - _reference(x, w)).abs().max().item() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tensor-core dots: CUDA")
@pytest.mark.parametrize("M", [1, 7, 64, 200])
def test_bf16_at_the_engines_shapes_matches_torch(M: int) -> None:
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 1024, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(2 * 3072, 1024, generator=g) / 32).to("cuda", torch.bfloat16)
    want = _reference(x, w).float()
    got = kernel.gate_up_silu(x, w).float()
    # the two GEMMs sum in different orders: a few bf16 ulps of the outputs (|y| up to ~8)
    assert (got - want).abs().max().item() <= 0.0625 + 1e-6
    assert (got - want).abs().mean().item() < 2e-3
    assert kernel.failure("cuda", torch.bfloat16) is None


def test_bad_shapes_and_no_cuda_are_clear() -> None:
    if kernel.triton is not None:
        with pytest.raises(ValueError, match=r"w must be \[2I, 8\]"):
            kernel.gate_up_silu(torch.zeros(2, 8), torch.zeros(5, 8))
    assert "CUDA" in kernel.failure("cpu", torch.float32)


def test_decode_steps_take_the_kernel_from_min_rows_on(monkeypatch) -> None:
    """The runner's rule (``gate_up.MIN_ROWS``): with ``fused_mlp`` on, a decode step of at least
    MIN_ROWS rows computes its MLP through ``gate_up_silu`` (here a torch stand-in, so this runs
    on the CPU), a smaller one through the two launches, with the same logits either way."""
    from miles.engines import EngineConfig
    from miles.engines.runner import ModelRunner

    from .helpers import make_model

    rows_seen = []

    def stand_in(x: torch.Tensor, w: torch.Tensor, launch=None) -> torch.Tensor:
        rows_seen.append(x.shape[0])
        return _reference(x, w)

    monkeypatch.setattr(kernel, "gate_up_silu", stand_in)
    model = make_model().eval().requires_grad_(False)
    model.fuse_projections()  # the fast path, as the engine runs it
    runner = ModelRunner(model, EngineConfig(max_batch_size=16, max_seq_len=64, kv_block=16))
    layers = runner.model.config.num_hidden_layers
    for n in (kernel.MIN_ROWS - 1, kernel.MIN_ROWS):
        tokens, positions = torch.arange(5, 5 + n), torch.arange(n)
        with torch.no_grad():
            runner.fused_mlp = False
            want = runner.decode_eager(tokens, positions, 16).logits
            runner.fused_mlp = True
            got = runner.decode_eager(tokens, positions, 16).logits
        assert (got - want).abs().max().item() < 1e-5
    assert rows_seen == [kernel.MIN_ROWS] * layers  # the smaller step kept the two launches
