"""LoRA RL: low-rank adapters trained over frozen base weights (``--lora-rank`` > 0).

``apply_lora`` replaces each targeted ``nn.Linear`` of a ``CausalLM`` with a ``LoRALinear``
that keeps the same (now frozen) ``weight`` and ``bias`` and adds ``lora_A`` [r, in] and
``lora_B`` [out, r]: ``y = x W^T + b + (α/r) · B(A(dropout(x)))``, PEFT's forward. Its
parameter names are PEFT's without the ``base_model.model.`` prefix and the adapter name
(``model.layers.0.self_attn.q_proj.lora_A.weight``), so ``save_peft_adapter`` writes
``adapter_config.json`` + ``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained``
loads onto the transformers model as is.

Only the adapters train, so the optimizer holds AdamW state for them alone, the frozen base
is kept in the training compute dtype (bf16 on a GPU: half a float32 copy; ``cast_for_training``),
and a weight update ships only them (``adapter_update``): ``lora_A`` and ``lora_B`` pre-multiplied by
α/r, so an engine needs no LoRA settings to apply them (``miles.engines.lora``).

On one rank the frozen q/k/v and gate/up are laid out as the engine's fused matrices
(``fuse_frozen_base``), so a colocated engine serves this base as is instead of a copy of its
own (``miles.engines.shared``; it then applies the shipped adapters unmerged).

Target names are PEFT's: a module name's last part (``q_proj`` ... ``down_proj``), or
``all-linear`` — every linear layer of the decoder except the LM head and the MoE router.
``lora_problems`` checks targets and rank against a (meta) model before a run starts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NOT_ALL_LINEAR = ("lm_head", "gate", "shared_expert_gate")  # PEFT leaves the head out; routers stay exact


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (PEFT's ``lora.Linear``)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        dev = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=dev, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=dev, dtype=base.weight.dtype)
        if dev.type != "meta":
            # PEFT's init: A as nn.Linear's default, B zero, so training starts at the base model.
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def _targets(model: nn.Module, targets: Sequence[str]) -> list[str]:
    wanted = set(targets)
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in wanted or name in wanted or ("all-linear" in wanted and leaf not in _NOT_ALL_LINEAR):
            out.append(name)
    return out


def lora_problems(model: nn.Module, rank: int, targets: Sequence[str]) -> list[str]:
    """What is wrong with adapters of ``rank`` on ``targets`` of ``model`` (a meta model will do)."""
    if rank <= 0:
        return []
    names = _targets(model, targets)
    if not names:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        return [f"--lora-target-modules {' '.join(targets)} matches no linear layer of this model "
                f"(its linear layers: {', '.join(leaves)}, or all-linear)"]
    modules = dict(model.named_modules())
    too_small = [n for n in names if rank > min(modules[n].in_features, modules[n].out_features)]
    if too_small:
        m = modules[too_small[0]]
        return [f"--lora-rank {rank} is larger than {too_small[0]} ({m.out_features}x{m.in_features}): "
                f"a rank above min(in, out) = {min(m.in_features, m.out_features)} adds nothing"]
    return []


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets: Sequence[str]) -> list[str]:
    """Freeze every parameter of ``model`` and wrap the targeted linears; returns their names."""
    problems = lora_problems(model, rank, targets)
    if problems:
        raise ValueError(problems[0])
    names = _targets(model, targets)
    model.requires_grad_(False)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, LoRALinear(getattr(parent, leaf), rank, alpha, dropout))
    return names


def cast_for_training(model: nn.Module, base_dtype: torch.dtype) -> int:
    """Store the frozen base's matrices (every linear and expert weight, the LM head) in
    ``base_dtype``, the forward's compute dtype, and everything else — the adapters, norms,
    biases, the embedding (the residual stream starts there, as in full-parameter training)
    and buffers — in float32. Under autocast the base GEMMs ran in ``base_dtype`` already, so
    the forward is the same while the base takes half the memory of a float32 copy (the
    weights are frozen: no update is lost to rounding). Returns the base matrices' numel."""
    embed = model.model.embed_tokens.weight
    cast = 0
    for p in model.parameters():
        if not p.is_floating_point():
            continue
        base = not p.requires_grad and p.ndim >= 2 and p is not embed
        want = base_dtype if base else torch.float32
        if base:
            cast += p.numel()
        if p.dtype != want:
            p.data = p.data.to(want)
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != torch.float32:
                setattr(module, name, buf.float())
    return cast


def is_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors (live, unscaled), named as in the model's state dict."""
    return {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


def adapter_update(model: nn.Module, *, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """What a weight update ships: every ``lora_A`` as is and every ``lora_B`` times α/r."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            a, b = module.lora_A.weight.detach(), module.lora_B.weight.detach() * module.scaling
            if dtype is not None:
                a, b = a.to(dtype), b.to(dtype)
            yield f"{name}.lora_A.weight", a.contiguous()
            yield f"{name}.lora_B.weight", b.contiguous()


def _settings(model: nn.Module) -> tuple[int, float, float, list[str]]:
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    _, first = mods[0]
    rank = first.lora_A.out_features
    dropout = first.dropout.p if isinstance(first.dropout, nn.Dropout) else 0.0
    return rank, first.scaling * rank, dropout, sorted({n.rsplit(".", 1)[-1] for n, _ in mods})


def save_peft_adapter(model: nn.Module, directory: str | Path, base_model_path: str | None = None) -> Path:
    """Write the adapters as PEFT does: ``adapter_config.json`` + ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rank, alpha, dropout, targets = _settings(model)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": base_model_path, "modules_to_save": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tensors = {f"base_model.model.{k}": v.detach().to("cpu", copy=True).contiguous()
               for k, v in adapter_state(model).items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return directory


def merged_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """HF-named full weights with every adapter merged (W + α/r · B A), for a plain HF export."""
    modules = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        if ".lora_" in name or (tied and name == "lm_head.weight"):
            continue
        m = modules.get(name)
        if m is not None:
            t = t + m.scaling * (m.lora_B.weight @ m.lora_A.weight)
        yield name, t.detach().contiguous()


_FUSED_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


@torch.no_grad()
def fuse_frozen_base(model: nn.Module) -> int:
    """Lay each layer's frozen q/k/v (and dense gate/up) base weights out as one matrix, each
    projection's ``weight`` a row block of it, as the engine's fused GEMMs read them: an engine
    serving these tensors (``miles.engines.shared``) then fuses them as views instead of
    concatenating copies. The forward is unchanged (each block is a contiguous matrix, still
    frozen). Idempotent; returns the groups laid out anew."""
    from miles.models.fused import adjacent_rows

    done = 0
    for layer in model.model.layers:
        for parent_name, leaves in _FUSED_GROUPS:
            parent = getattr(layer, parent_name, None)
            mods = [getattr(parent, leaf, None) for leaf in leaves]
            if any(m is None or not isinstance(getattr(m, "weight", None), Tensor) for m in mods):
                continue  # MoE blocks: experts stay as they are
            weights = [m.weight for m in mods]
            if any(w.requires_grad for w in weights) or adjacent_rows([w.detach() for w in weights]) is not None:
                continue
            fused = torch.cat([w.detach() for w in weights])
            for m, view in zip(mods, fused.split([w.shape[0] for w in weights])):
                m.weight = nn.Parameter(view, requires_grad=False)
            done += 1
    return done


def base_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The frozen base, HF-named (every parameter but the adapters), as the live tensors: what
    a colocated engine serves instead of a copy of its own."""
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()
            if ".lora_A." not in k and ".lora_B." not in k}
