"""Quantized weights on the wire and on disk, in the formats of ``miles.models.quant``.

**Wire** (trainer → engines under ``--quantization fp8|int4-qat``): each quantized linear's
``X.weight`` travels as its stored form — FP8 e4m3 values as a ``uint8`` view ``[N, K]`` or
packed INT4 ``[N, K/2]`` — plus ``X.weight_scale``, its float32 scales as an ``int32`` view
(integer tensors are never cast by a transport's wire dtype, so the scales arrive bit-exact).
The engine's ``WireDecoder`` pairs them (a bucket may split a pair), dequantizes into its
parameters' dtype and keeps the pair itself (``take_exact``), which the engine's commit hands
to ``quant.refresh``: the quantized layers then serve the trainer's values and scales as
sent, not a requantization of the dequantized parameters (which gives them back only while
every block's maximum survives the round trip through the parameters' dtype). FP8 ships
about half the bytes of bf16, INT4 about 0.27×.

**Disk** (``save_quantized``): an HF directory beside the bf16 one, with compressed-tensors'
names where they fit — FP8: ``X.weight`` (``F8_E4M3``) and ``X.weight_scale`` (float32,
``[ceil(N/128), ceil(K/128)]``, the multiplier that dequantizes); INT4: ``X.weight_packed``
(uint8, two values a byte, low nibble first, each ``q + 8`` — compressed-tensors packs eight
into an int32 instead), ``X.weight_scale`` (float32 ``[N, K/group]``) and ``X.weight_shape``.
``config.json`` gains ``quantization_config`` (``quant_method: compressed-tensors``, with the
format, group or block size and the targeted module names); ``load_pretrained`` reads it
back, dequantized into the requested dtype.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from miles.models.quant import QuantSpec, dequantize_weight, quantize_weight, spec_of

SCALE = ".weight_scale"


def wire_tensors(named: Iterable[tuple[str, Tensor]], spec: QuantSpec,
                 dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """The trainer's export, with every targeted weight in its quantized wire form (the
    others cast to ``dtype`` when given)."""
    for name, t in named:
        if name.endswith(".weight") and spec.targets_name(name[: -len(".weight")]):
            q, scale = quantize_weight(t, spec)
            yield name, q.view(torch.uint8)
            yield name[: -len(".weight")] + SCALE, scale.float().contiguous().view(torch.int32)
        else:
            yield name, t if dtype is None or not t.is_floating_point() else t.to(dtype).contiguous()


class WireDecoder:
    """Pairs ``X.weight`` (uint8) with ``X.weight_scale`` across buckets and dequantizes;
    keeps each decoded pair, in its stored form, until ``take_exact``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.values: dict[str, Tensor] = {}  # X.weight -> its wire values, waiting for the scale
        self.scales: dict[str, Tensor] = {}  # X.weight -> its scales, waiting for the values
        self.exact: dict[str, tuple[Tensor, Tensor]] = {}  # X.weight -> (stored values, float32 scales) decoded

    def decode(self, named: Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
        out = []
        for name, t in named:
            if name.endswith(SCALE):
                key = name[: -len(SCALE)] + ".weight"
                q, scale = self.values.pop(key, None), t
                if q is None:
                    self.scales[key] = t
                    continue
            elif name.endswith(".weight") and t.dtype == torch.uint8:
                key, q, scale = name, t, self.scales.pop(name, None)
                if scale is None:
                    self.values[key] = t
                    continue
            else:
                out.append((name, t))
                continue
            stored, spec = _stored_form(q, scale.view(torch.float32))
            self.exact[key] = stored
            out.append((key, dequantize_weight(*stored, spec, self.dtype)))
        return out

    def take_exact(self) -> dict[str, tuple[Tensor, Tensor]]:
        """The stored forms decoded since the last call (for ``quant.refresh`` at the commit)."""
        exact, self.exact = self.exact, {}
        return exact

    def clear(self) -> None:
        self.values.clear()
        self.scales.clear()
        self.exact.clear()


def _stored_form(q: Tensor, scale: Tensor) -> tuple[tuple[Tensor, Tensor], QuantSpec]:
    """The wire's (uint8 values, float32 scales) as the quantizer stores them, and its spec."""
    N, K = q.shape
    if tuple(scale.shape) == ((N + 127) // 128, (K + 127) // 128):  # FP8: 128 x 128 blocks
        return (q.view(torch.float8_e4m3fn), scale), QuantSpec("fp8")
    group = K * 2 // scale.shape[1]  # INT4: [N, K/2] bytes, [N, K/group] scales
    return (q, scale), QuantSpec("int4", group)


def wire_bytes(named: Iterable[tuple[str, Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


# ---- checkpoints ---------------------------------------------------------------------------------
def save_quantized(model: nn.Module, path: str | Path, spec: QuantSpec | None = None) -> Path:
    """Write ``model`` (its master weights quantized by ``spec``, default the model's own) as
    a quantized HF directory; returns the path."""
    spec = spec or spec_of(model)
    if spec is None:
        raise ValueError("save_quantized needs a QuantSpec (the model is not quantized)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    state: dict[str, Tensor] = {}
    targets = []
    for name, t in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach().cpu()
        base = name[: -len(".weight")]
        if name.endswith(".weight") and spec.targets_name(base):
            q, scale = quantize_weight(t, spec)
            targets.append(base)
            state[base + SCALE] = scale.float().contiguous()
            if spec.kind == "fp8":
                state[name] = q.contiguous()
            else:
                state[base + ".weight_packed"] = q
                state[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
        else:
            state[name] = t.contiguous().clone()
    hf = cfg.to_hf(dtype=str(next(iter(model.parameters())).dtype).removeprefix("torch."))
    hf["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if spec.kind == "fp8" else "pack-quantized",
        "miles": {"kind": spec.kind, "block_size": [128, 128], "activation_group": 128,
                  "group_size": spec.group_size, "targets": spec.targets, "modules": targets},
    }
    if spec.kind == "int4":
        hf["quantization_config"]["miles"].pop("block_size")
        hf["quantization_config"]["miles"].pop("activation_group")
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def quantized_config(path: str | Path) -> dict | None:
    """The ``quantization_config.miles`` block of a directory's config.json, if any."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        return None
    q = json.loads(cfg_path.read_text()).get("quantization_config") or {}
    return q.get("miles")


def load_quantized_state(path: str | Path, dtype: torch.dtype) -> dict[str, Tensor]:
    """The HF state dict of a ``save_quantized`` directory, dequantized into ``dtype``."""
    meta = quantized_config(path)
    if meta is None:
        raise ValueError(f"{path}: config.json has no miles quantization_config")
    spec = QuantSpec(meta["kind"], int(meta.get("group_size", 128)), meta.get("targets", "experts"))
    raw: dict[str, Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            raw.update({k: fh.get_tensor(k) for k in fh.keys()})
    state = {}
    for base in meta["modules"]:
        scale = raw.pop(base + SCALE)
        if spec.kind == "fp8":
            q = raw.pop(base + ".weight")
        else:
            q = raw.pop(base + ".weight_packed")
            shape = tuple(raw.pop(base + ".weight_shape").tolist())
            if (q.shape[0], q.shape[1] * 2) != shape:
                raise ValueError(f"{path}: {base}.weight_packed has shape {tuple(q.shape)}, weight_shape {shape}")
        state[base + ".weight"] = dequantize_weight(q, scale, spec, dtype)
    state.update({k: v.to(dtype) if v.is_floating_point() else v for k, v in raw.items()})
    return state
