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


def test_unified_fp8_trainer_forward_is_the_engines_and_its_gradient_goes_straight_through() -> None:
    """Under --quantization fp8 on CUDA the trainer's forward with gradients runs the engine's
    FP8 GEMM: its logits equal the engine's (no-grad) forward bit for bit, where the FP8 GEMM
    runs (K a multiple of 512 here); the weight and input gradients are those of the
    fake-quantized linear (straight-through), to bf16 round-off."""
    from miles.models.quant import fake_quant_act, fake_quant_weight

    torch.manual_seed(0)
    cfg = tiny_config(hidden_size=512, intermediate_size=1024, head_dim=64, initializer_range=0.02)
    model = CausalLM(cfg).to("cuda", torch.bfloat16)
    apply_quantization(model, QuantSpec("fp8", 128, "all-linear"))
    ids = torch.randint(3, cfg.vocab_size, (2, 32), device="cuda")
    with torch.no_grad():
        engine = model(ids).logits
    train = model(ids).logits
    assert any(path != "dequantized" for path in lowp.FP8_PATH.values()), lowp.FP8_PATH
    assert torch.equal(engine, train.detach())
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 7, layer.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(3, 7, layer.out_features, device="cuda", dtype=torch.bfloat16)
    gx, gw = torch.autograd.grad((layer(x) * g).sum(), [x, layer.weight])
    spec = layer.quant
    rx, rw = torch.autograd.grad((F.linear(fake_quant_act(x), fake_quant_weight(layer.weight, spec)) * g).sum(),
                                 [x, layer.weight])
    for got, ref in ((gx, rx), (gw, rw)):
        assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 2e-2


@pytest.mark.parametrize("hidden,head_dim", [(96, 32), (512, 64)])
def test_unified_fp8_engine_is_the_trainer_bit_for_bit_under_true_on_policy(hidden: int, head_dim: int) -> None:
    """Under --true-on-policy's kernels, a bf16 engine fed the trainer's quantized export
    (values and scales as sent) and run one sequence a call gives the logits of the trainer
    (float32 master weights under autocast, gradients on, the whole batch) bit for bit: every
    activation quantizer sees the same input on both sides. Widths of 96 (one partial 128
    block a row) and 512 (where lowp's FP8 GEMMs would otherwise run)."""
    import copy

    from miles.models import invariant
    from miles.models.quant import refresh
    from miles.models.quant_io import WireDecoder, wire_tensors

    torch.manual_seed(0)
    spec = QuantSpec("fp8")
    cfg = tiny_config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=head_dim, initializer_range=0.05)
    master = CausalLM(cfg).to("cuda")
    trainer = copy.deepcopy(master)
    apply_quantization(trainer, spec)
    engine = copy.deepcopy(master).to(torch.bfloat16).requires_grad_(False)
    apply_quantization(engine, spec)
    decoder = WireDecoder(torch.bfloat16)
    engine.load_state_dict(dict(decoder.decode(wire_tensors(master.state_dict().items(), spec))))
    refresh(engine, decoder.take_exact())
    ids = torch.randint(3, cfg.vocab_size, (3, 40), device="cuda")
    with invariant.mode(keys=64, device="cuda"):
        with torch.no_grad():
            got = torch.cat([engine(ids[i : i + 1]).logits for i in range(ids.shape[0])])
        with torch.enable_grad(), torch.autocast("cuda", torch.bfloat16):
            want = trainer(ids).logits.detach()
    assert torch.equal(got, want)
