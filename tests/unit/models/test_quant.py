"""The quantizer (miles.models.quant): error bounds, packing, STE gradients, bad inputs,
quantized wire format and checkpoint export."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from miles.models import CausalLM, load_pretrained, save_pretrained, tiny_config
from miles.models import quant
from miles.models.quant import QuantSpec, apply_quantization
from miles.models.quant_io import WireDecoder, load_quantized_state, save_quantized, wire_bytes, wire_tensors

FP8, INT4 = QuantSpec("fp8"), QuantSpec("int4", 32, "all-linear")


def test_fp8_weight_round_trip_within_half_an_e4m3_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(300, 200) * torch.logspace(-3, 1, 200)  # partial edge blocks, wide range
    q, scale = quant.fp8_quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2) and scale.dtype == torch.float32
    back = quant.fp8_dequantize_weight(q, scale)
    s = quant._expand(scale, 128, 128, w.shape)
    # e4m3 keeps 3 mantissa bits: relative error ≤ 2^-4 for normals, absolute ≤ 2^-10 · scale below
    assert ((back - w).abs() <= torch.maximum(w.abs() / 16, s * 2**-9) + 1e-12).all()
    assert back.abs().amax().item() == pytest.approx(w.abs().amax().item(), rel=1e-6)  # the maximum maps to 448


def test_fp8_activation_groups_of_128() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 256)
    x[0, 0, :128] *= 1000  # one group's outlier leaves the other group's scale alone
    q, scale = quant.fp8_quantize_act(x)
    assert scale.shape == (3, 5, 2)
    assert scale[0, 0, 1] == pytest.approx(x[0, 0, 128:].abs().max().item() / 448)
    err = (quant.fp8_qdq_act(x) - x).abs()
    s = scale.repeat_interleave(128, -1)
    assert (err <= torch.maximum(x.abs() / 16, s * 2**-9) + 1e-6).all()


def test_int4_round_trip_and_packed_layout() -> None:
    w = torch.randn(64, 256)
    q, scale = quant.int4_quantize(w, 128)
    assert scale.shape == (64, 2) and int(q.abs().max()) == 7
    back = quant.int4_dequantize(q, scale)
    assert ((back - w).abs() <= scale.repeat_interleave(128, 1) / 2 + 1e-6).all()  # half a step
    packed = quant.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 128)
    assert torch.equal(quant.unpack_int4(packed), q)
    every = torch.arange(-8, 8, dtype=torch.int8).repeat(4, 2)
    assert torch.equal(quant.unpack_int4(quant.pack_int4(every)), every)
    assert int(packed[0, 0]) == (int(q[0, 0]) + 8) | ((int(q[0, 1]) + 8) << 4)  # low nibble first


@pytest.mark.parametrize("spec", [FP8, INT4])
def test_ste_gradients_are_the_gradients_at_the_dequantized_weights(spec: QuantSpec) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    ref_w = quant.qdq_weight(lin.weight.detach(), spec).requires_grad_(True)
    x = torch.randn(7, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    apply_quantization(_Wrap(lin), spec)
    y = lin(x)
    xin = quant.fp8_qdq_act(x_ref) if spec.kind == "fp8" else x_ref
    y_ref = F.linear(xin, ref_w, lin.bias)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    assert torch.equal(lin.weight.grad, ref_w.grad)
    if spec.kind == "int4":
        assert torch.equal(x.grad, x_ref.grad)
    else:  # through the activation quantizer too, straight through
        assert torch.allclose(x.grad, g @ ref_w.detach(), atol=1e-6)


class _Wrap(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"o_proj": lin})])


def test_bad_inputs_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="does not divide the input dimension 64"):
        apply_quantization(CausalLM(tiny_config()), QuantSpec("int4", 48, "all-linear"))
    with pytest.raises(ValueError, match="dense model: use --int4-targets all-linear"):
        apply_quantization(CausalLM(tiny_config()), QuantSpec("int4", 32, "experts"))
    with pytest.raises(ValueError, match="even input dimension"):
        quant.pack_int4(torch.zeros(2, 3, dtype=torch.int8))
    assert quant.check_device(FP8, "cpu") is None


def test_targets_skip_routers_embeddings_and_head() -> None:
    model = CausalLM(tiny_config(moe=True, shared_expert_intermediate_size=32))
    assert apply_quantization(model, QuantSpec("int4", 32, "experts")) == 2 * 8 * 3
    names = {n for n, m in model.named_modules() if isinstance(m, quant.QuantLinear)}
    assert all(".experts." in n for n in names)
    dense = CausalLM(tiny_config())
    apply_quantization(dense, FP8)
    assert {n for n, m in dense.named_modules() if isinstance(m, quant.QuantLinear)} == {
        f"model.layers.{i}.{p}" for i in range(2) for p in
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert type(dense.lm_head) is nn.Linear and "lm_head.weight" in dense.state_dict()


@pytest.mark.parametrize("spec,ratio", [(FP8, 0.51), (QuantSpec("int4", 128, "all-linear"), 0.27)])
def test_wire_ships_quantized_bytes_and_decodes_to_the_same_forward(spec: QuantSpec, ratio: float) -> None:
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
    model = CausalLM(cfg)
    apply_quantization(model, spec)
    named = [(n, t.detach()) for n, t in model.state_dict().items()]
    layer = [(n, t) for n, t in named if ".layers." in n and n.endswith("proj.weight")]
    bf16 = wire_bytes((n, t.to(torch.bfloat16)) for n, t in layer)
    wired = list(wire_tensors(layer, spec))
    assert wire_bytes(wired) <= ratio * bf16
    decoder = WireDecoder(torch.float32)
    got = dict(decoder.decode(wired[1::2]))  # scales first: every pair waits for its values
    assert not got
    got = dict(decoder.decode(wired[0::2]))
    assert set(got) == {n for n, _ in layer} and not decoder.values and not decoder.scales
    for n, t in layer:  # the engine's quantizer gives back exactly what the trainer used
        assert torch.equal(quant.qdq_weight(got[n], spec), quant.qdq_weight(t, spec))


@pytest.mark.parametrize("spec", [FP8, QuantSpec("int4", 32, "experts")])
def test_quantized_checkpoint_round_trips(tmp_path, spec: QuantSpec) -> None:
    torch.manual_seed(0)
    model = CausalLM(tiny_config(moe=True))
    apply_quantization(model, spec)
    save_pretrained(model, tmp_path / "bf16")
    out = save_quantized(model, tmp_path / "q")
    files = {k for k in __import__("safetensors").safe_open(str(out / "model.safetensors"), "pt").keys()}
    name = "model.layers.0.mlp.experts.3.down_proj"
    assert f"{name}.weight_scale" in files
    assert (f"{name}.weight" if spec.kind == "fp8" else f"{name}.weight_packed") in files
    back = load_pretrained(out, dtype=torch.float32)
    for n, t in model.state_dict().items():
        base = n[: -len(".weight")]
        want = quant.qdq_weight(t, spec) if n.endswith(".weight") and spec.targets_name(base) else t
        assert torch.equal(back.state_dict()[n], want), n
    assert set(load_quantized_state(out, torch.float32)) == set(model.state_dict())


def test_the_fp8_gemm_probe_refuses_a_form_that_reads_the_wrong_scales(monkeypatch) -> None:
    """The probe keeps the first block-wise GEMM form that matches the dequantized product on
    operands whose group and block scales differ by orders of magnitude: a form that reads
    the scales of the wrong row or block (here: the activation scales of the next row, and the
    weight scales transposed) is refused with its error recorded, and a correct one is kept."""
    import torch.nn.functional as F

    from miles.kernels import lowp
    from miles.kernels.quantize import BLOCK, fp8_dequantize_weight

    def dequantized(xq, xs, wq, ws, dt):  # noqa: ANN001, ANN202
        return F.linear(xq.float() * xs.repeat_interleave(BLOCK, -1), fp8_dequantize_weight(wq, ws)).to(dt)

    def wrong_rows(xq, xs, wq, ws, dt):  # noqa: ANN001, ANN202
        return dequantized(xq, xs.roll(1, 0), wq, ws, dt)

    def wrong_blocks(xq, xs, wq, ws, dt):  # noqa: ANN001, ANN202
        return dequantized(xq, xs, wq, ws.flip(0), dt)

    monkeypatch.setattr(lowp, "_mm_forms", lambda: {"rows": wrong_rows, "blocks": wrong_blocks, "right": dequantized})
    monkeypatch.setattr(lowp, "FP8_ERRORS", {})
    assert lowp._probe(torch.device("cpu"), torch.float32) == "right"
    assert set(lowp.FP8_ERRORS) == {"rows", "blocks"}
    assert all("relative error" in e for e in lowp.FP8_ERRORS.values())


@pytest.mark.parametrize("spec", [FP8, INT4])
def test_a_bf16_engine_serves_the_trainers_values_and_scales_as_sent(spec: QuantSpec) -> None:
    """The engine dequantizes the wire into its bf16 parameters and ``refresh`` serves the
    decoder's stored forms as sent: the engine's layer is the trainer's quantization exactly,
    whether or not it ran before the update."""
    torch.manual_seed(0)
    cfg = tiny_config(hidden_size=96, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=24)
    trainer = CausalLM(cfg)  # float32 master weights
    apply_quantization(trainer, spec)
    engine = CausalLM(cfg).to(torch.bfloat16)
    apply_quantization(engine, spec)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    name = "model.layers.1.mlp.up_proj"
    layer, master = engine.get_submodule(name), trainer.get_submodule(name).weight.detach()
    with torch.no_grad():
        layer(x)  # its own weights cached: the update replaces them in place
    decoder = WireDecoder(torch.bfloat16)
    engine.load_state_dict(dict(decoder.decode(wire_tensors(trainer.state_dict().items(), spec))))
    want = F.linear(quant.fp8_qdq_act(x) if spec.kind == "fp8" else x, quant.qdq_weight(master, spec).to(torch.bfloat16))
    sent_q, sent_scale = quant.quantize_weight(master, spec)
    with torch.no_grad():
        quant.refresh(engine, decoder.take_exact())
        assert not decoder.exact
        assert torch.equal(layer._cache[1][1], sent_scale)
        assert torch.equal(layer._cache[1][0].view(torch.uint8), sent_q.view(torch.uint8))
        assert torch.equal(layer(x), want)
        fresh = CausalLM(cfg).to(torch.bfloat16)  # a layer that never ran takes the sent form too
        apply_quantization(fresh, spec)
        fresh.load_state_dict(engine.state_dict())
        quant.refresh(fresh, {f"{name}.weight": (sent_q, sent_scale)})
        assert torch.equal(fresh.get_submodule(name)(x), want)


@pytest.mark.parametrize("spec", [FP8, INT4])
def test_a_float32_checkpoint_quantizes_alike_in_the_trainer_and_a_bf16_engine(spec: QuantSpec) -> None:
    """Before the first update the engine quantizes its own bf16 copy of the checkpoint and the
    trainer its float32 master weights: the quantizer reads both as bf16, so the stored forms
    agree (a block's maximum is then a bf16 value, and ``448·s`` or ``7·s`` survive a bf16
    round trip, so requantizing the dequantized weight gives the scales back too)."""
    torch.manual_seed(0)
    w = torch.randn(200, 256) * torch.logspace(-2, 0, 256)
    q32, s32 = quant.quantize_weight(w, spec)
    q16, s16 = quant.quantize_weight(w.to(torch.bfloat16), spec)
    assert torch.equal(s32, s16) and torch.equal(q32.view(torch.uint8), q16.view(torch.uint8))
    back = quant.dequantize_weight(q32, s32, spec, torch.bfloat16)
    q2, s2 = quant.quantize_weight(back, spec)
    assert torch.equal(s2, s32) and torch.equal(q2.view(torch.uint8), q32.view(torch.uint8))


def test_refresh_refuses_a_stored_form_of_another_shape() -> None:
    model = CausalLM(tiny_config())
    apply_quantization(model, FP8)
    layer = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        layer(torch.randn(2, layer.in_features))
        wrong = quant.quantize_weight(torch.randn(layer.out_features + 1, layer.in_features), FP8)
        with pytest.raises(ValueError, match="does not match"):
            quant.refresh(model, {"model.layers.0.mlp.up_proj.weight": wrong})


@pytest.mark.parametrize("spec", [FP8, INT4])
def test_an_autocast_trainer_forward_is_the_bf16_engines_bit_for_bit(spec: QuantSpec) -> None:
    """A float32 master under bf16 autocast (the trainer on a GPU, here on the CPU) against a
    bf16 engine fed its quantized export: the quantized model keeps its residual stream in the
    autocast dtype, as the engine's is, so every quantizer sees the engine's inputs and the
    logits agree bit for bit (a float32 stream tipped FP8 roundings: unified FP8's mismatch
    was then most of rollout-only FP8's)."""
    torch.manual_seed(0)
    cfg = tiny_config(hidden_size=96, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=24, initializer_range=0.1)
    trainer = CausalLM(cfg)
    apply_quantization(trainer, spec)
    engine = CausalLM(cfg).to(torch.bfloat16).requires_grad_(False)
    apply_quantization(engine, spec)
    decoder = WireDecoder(torch.bfloat16)
    engine.load_state_dict(dict(decoder.decode(wire_tensors(trainer.state_dict().items(), spec))))
    quant.refresh(engine, decoder.take_exact())
    ids = torch.randint(3, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        want = engine(ids).logits
    with torch.autocast("cpu", torch.bfloat16):
        got = trainer(ids).logits
    assert got.requires_grad and torch.equal(got.detach(), want)
