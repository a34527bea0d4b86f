"""Hugging Face checkpoint IO: ``config.json`` + ``*.safetensors`` (+ tokenizer files).

The on-disk layout is what released HF checkpoints use — per-expert tensor names
(``mlp.experts.{e}.gate_proj.weight``), which transformers 5 fuses into 3-D tensors on
load by itself — and our ``state_dict()`` uses the same names, so load and save are the
identity and the weight broadcaster ships HF-named tensors. No hub access: ``path`` is a
local directory.

Loading is strict: a tensor the config does not expect, one it expects but the files lack,
or a shape that differs is an error that names the tensor (a config that does not match
its checkpoint must never half-load).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles.models.config import ModelConfig
from miles.models.model import CausalLM
from miles.models.quant_io import load_quantized_state, quantized_config

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # derived buffers some old checkpoints carry

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory is missing files or does not match its config."""


def default_dtype(device: torch.device | str) -> torch.dtype:
    """float32 on the CPU (exact parity, consistency tests); bfloat16 on accelerators."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def load_config(path: str | Path) -> ModelConfig:
    """The checkpoint's ``config.json`` as a ModelConfig; CheckpointError (naming the file)
    when it is missing, not JSON, or describes a model miles cannot build."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        hf = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{cfg_path}: not a JSON object")
    try:
        return ModelConfig.from_hf(hf)
    except (ValueError, KeyError, TypeError) as exc:  # ConfigError is a ValueError
        what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise CheckpointError(f"{cfg_path}: {what}") from None


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{path}: index names {f.name}, which is missing")
    return files


def check_checkpoint(path: str | Path) -> ModelConfig:
    """Check a checkpoint without loading its weights: config.json, and every tensor's name
    and shape from the safetensors headers against what the config implies. The CLI runs it
    before any actor starts, so a mismatch is one clear error, not a traceback from inside
    each actor that loads the weights. Returns the config."""
    path = Path(path)
    config = load_config(path)
    _check_tensors(path, _meta_model(config))
    return config


def _meta_model(config: ModelConfig) -> CausalLM:
    """The model of ``config`` with no storage: its state dict's names and shapes."""
    with torch.device("meta"):
        return CausalLM(config)


def _check_tensors(path: Path, model: CausalLM) -> list[tuple[Path, list[str]]]:
    """Names and shapes from the headers against ``model``'s; returns (file, tensor names to
    load) per file."""
    config = model.config
    tied = config.tie_word_embeddings
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if tied:
        expected.pop("lm_head.weight")
    found: set[str] = set()
    plan = []
    for file in _safetensor_files(path):
        names = []
        try:
            fh = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # a truncated or non-safetensors file
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
        with fh:
            for name in fh.keys():
                if tied and name == "lm_head.weight":  # as transformers does: the embedding is the head
                    log.warning("%s: config.json ties the word embeddings, so its lm_head.weight is ignored "
                                "(set tie_word_embeddings false to use it)", file)
                    continue
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in expected:
                    raise CheckpointError(
                        f"{file.name}: tensor {name!r} is not part of a {config.model_type} model "
                        f"with this config.json (layers={config.num_hidden_layers}, "
                        f"experts={config.num_experts})"
                    )
                shape = tuple(fh.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(
                        f"{file.name}: tensor {name!r} has shape {shape}, config.json implies "
                        f"{expected[name]}"
                    )
                names.append(name)
                found.add(name)
        plan.append((file, names))
    missing = sorted(set(expected) - found)
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{path}: tensors missing from the checkpoint: {missing[:5]}{more}")
    return plan


def load_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """Build a CausalLM from a local HF checkpoint directory.

    ``dtype`` None → float32 on the CPU, bfloat16 elsewhere. Raises CheckpointError naming
    the first tensor that is missing, unexpected, or of the wrong shape.
    """
    path = Path(path)
    config = load_config(path)
    dtype = dtype or default_dtype(device)
    model = _meta_model(config)
    if quantized_config(path) is not None:  # a save_quantized export: dequantized on load
        return _load_state(model, load_quantized_state(path, dtype), device)
    plan = _check_tensors(path, model)  # every name and shape, before any tensor is read
    state: dict[str, torch.Tensor] = {}
    for file, names in plan:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in names:
                state[name] = fh.get_tensor(name).to(device=device, dtype=dtype, copy=True)
    return _load_state(model, state, device)


def _load_state(model: CausalLM, state: dict[str, torch.Tensor], device: torch.device | str) -> CausalLM:
    state = {k: v.to(device) for k, v in state.items()}
    expected = set(model.state_dict()) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    if set(state) != expected:
        diff = sorted(set(state) ^ expected)
        raise CheckpointError(f"tensors missing or unexpected: {diff[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.rotary.reserve(model.rotary.default_length, device)
    return model.eval()


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with storage of its own (safetensors refuses shared storage, which
    fused projections create)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def save_pretrained(
    model: CausalLM,
    path: str | Path,
    *,
    tokenizer: Any = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> None:
    """Write ``config.json`` + ``model.safetensors`` (sharded with an index above
    ``max_shard_bytes``) [+ tokenizer files]; transformers' ``from_pretrained`` loads it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {
        k: _owned(v.detach().to("cpu"))
        for k, v in model.state_dict().items()
        if not (model.config.tie_word_embeddings and k == "lm_head.weight")
    }
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(model.config.to_hf(dtype=dtype), indent=2))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer is not None:
        tokenizer.save(path)
