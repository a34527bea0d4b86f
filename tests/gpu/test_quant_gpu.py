"""Low-precision GEMMs on CUDA (miles.kernels.lowp) against the quantizer's dequantized
arithmetic, and the engine's FP8/INT4 forward against the trainer's fake-quantized one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.kernels import lowp  # noqa: E402
from miles.models import CausalLM, tiny_config  # noqa: E402
from miles.models.quant import QuantSpec, apply_quantization, dequantize_weight, fp8_qdq_act, quantize_weight  # noqa: E402


@pytest.mark.parametrize("M", [1, 7, 64, 300])
@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_low_precision_gemm_matches_dequantized_product(M: int, kind: str) -> None:
    torch.manual_seed(0)
    spec = QuantSpec(kind, 128, "all-linear")
    w = torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(M, 1024, device="cuda", dtype=torch.bfloat16)
    stored = quantize_weight(w, spec)
    xin = fp8_qdq_act(x) if kind == "fp8" else x
    ref = F.linear(xin.float(), dequantize_weight(*stored, spec, torch.float32))
    got = lowp.linear(x, stored, spec).float()
    assert float((got - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_engine_forward_matches_trainer_forward_on_cuda(kind: str) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(hidden_size=256, intermediate_size=512, head_dim=64, initializer_range=0.02)
    model = CausalLM(cfg).to("cuda", torch.bfloat16)
    apply_quantization(model, QuantSpec(kind, 128, "all-linear"))
    ids = torch.randint(3, cfg.vocab_size, (2, 32), device="cuda")
    with torch.no_grad():
        engine = F.log_softmax(model(ids).logits, -1)
    with torch.enable_grad():
        train = F.log_softmax(model(ids).logits.detach(), -1)
    kl = float((engine.exp() * (engine - train)).sum(-1).mean())
    assert kl < 1e-3
