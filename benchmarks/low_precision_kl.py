"""Mismatch KL(engine ‖ trainer) of unified FP8 against rollout-only FP8, with the engine and
the trainer as a run pairs them (issue #40's "goal ≥ 10× lower").

    python benchmarks/low_precision_kl.py                           # countdown, h96 and h1024 shapes
    python benchmarks/low_precision_kl.py --shapes countdown --checkpoint runs/countdown/sft
    python benchmarks/low_precision.py --parts kl                    # the same, as one part

The two sides differ as in ``miles train``, not as two calls of one model:

- the **trainer**: float32 master weights, the forward under autocast in the engine's dtype
  (bf16 on CUDA) with gradients on (the path the loss and ``train/mismatch_kl`` see), the
  whole batch in one call;
- the **engine**: a copy in its own dtype, no gradients, one sequence a call (other GEMM
  shapes than the trainer's, as decode has). Its weights are the trainer's export: bf16 for
  ``bf16`` and ``rollout-fp8`` (which quantizes them itself), the quantized wire form for
  unified ``fp8`` (``WireDecoder`` and ``quant.refresh``: the trainer's values and scales).

Each pairing runs with the default kernels and under ``--true-on-policy``'s batch-invariant
ones (``invariant.enable``). Two more columns: unified FP8 at version 0 (the engine quantizes its
own bf16 copy of the weights; no update has come through the wire yet), and the unified engine
against itself run over the whole batch in one call (what the batch's shape alone changes). KL is over the whole vocabulary, averaged over tokens. Activation
quantization turns whatever differs before a quantizer into whole FP8 steps, so unified FP8
sits near bf16's mismatch only where the two forwards agree bit for bit up to each quantizer.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from miles.kernels import lowp  # noqa: E402
from miles.models import CausalLM, invariant, load_pretrained, tiny_config  # noqa: E402
from miles.models.quant import QuantSpec, apply_quantization, refresh  # noqa: E402
from miles.models.quant_io import WireDecoder, wire_tensors  # noqa: E402

# (model config, (sequences, tokens)); countdown is examples/countdown/sft.py's model, h96 the
# same widths with head dim 32 (the true-on-policy attention kernel takes powers of two)
SHAPES: dict[str, tuple[dict, tuple[int, int]]] = {
    "countdown": (dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=24, vocab_size=288), (8, 96)),
    "h96": (dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=288), (8, 96)),
    "tiny": (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=1024), (4, 64)),
    "h1024": (dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=64, vocab_size=32768), (4, 256)),
}
FP8 = QuantSpec("fp8")


def trainer_logprobs(master: CausalLM, spec: QuantSpec | None, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    model = copy.deepcopy(master)
    apply_quantization(model, spec)
    model.requires_grad_(True)
    with torch.enable_grad(), torch.autocast(ids.device.type, dtype, enabled=dtype != torch.float32):
        logits = model(ids).logits.float().detach()
    return F.log_softmax(logits, -1)


def engine_logprobs(master: CausalLM, spec: QuantSpec | None, unified: bool, ids: torch.Tensor,
                    dtype: torch.dtype, rows: int = 1) -> torch.Tensor:
    """The engine's log-probs, ``rows`` sequences a call (all of them: the batch dependence alone)."""
    model = copy.deepcopy(master).to(dtype).requires_grad_(False)
    apply_quantization(model, spec)
    if unified:  # the trainer's quantized export, decoded as the engine's weight update is
        decoder = WireDecoder(dtype)
        model.load_state_dict(dict(decoder.decode(wire_tensors(master.state_dict().items(), spec))))
        refresh(model, decoder.take_exact())
    with torch.no_grad():
        out = [model(ids[i : i + rows]).logits.float() for i in range(0, ids.shape[0], rows)]
    return F.log_softmax(torch.cat(out), -1)


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum(-1).mean())


def measure(shape: str, device: str, dtype: torch.dtype, checkpoint: str | None, invariant_too: bool) -> list[dict]:
    overrides, (B, T) = SHAPES[shape]
    torch.manual_seed(0)
    if checkpoint:
        master = load_pretrained(checkpoint, dtype=torch.float32, device=device)
    else:
        master = CausalLM(tiny_config(initializer_range=0.02, max_position_embeddings=max(T, 512), **overrides))
    master = master.to(device, torch.float32).eval()
    ids = torch.randint(3, master.config.vocab_size, (B, T), device=device)
    out = []
    for forward in ("default", "true-on-policy") if invariant_too else ("default",):
        if forward == "true-on-policy":
            invariant.enable(keys=T, device=device)
        lowp.FP8_PATH.clear()
        row = {"shape": shape, "forward": forward, "tokens": B * T}
        try:
            trainer = {None: trainer_logprobs(master, None, ids, dtype), FP8: trainer_logprobs(master, FP8, ids, dtype)}
            own = engine_logprobs(master, FP8, False, ids, dtype)  # FP8 of its own copy of the weights
            row["bf16"] = kl(engine_logprobs(master, None, False, ids, dtype), trainer[None])
            row["rollout-fp8"] = kl(own, trainer[None])
            engine = engine_logprobs(master, FP8, True, ids, dtype)
            row["fp8"] = kl(engine, trainer[FP8])
            row["fp8 version 0"] = kl(own, trainer[FP8])  # before the first update: no wire yet
            # the same engine over the whole batch in one call: what the batch's shape alone changes
            row["fp8 engine vs itself"] = kl(engine, engine_logprobs(master, FP8, True, ids, dtype, rows=B))
            row["fp8_paths"] = sorted(set(lowp.FP8_PATH.values()))
        except Exception as exc:  # noqa: BLE001 - e.g. head dim 24, which the mode's attention kernel refuses
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            if forward == "true-on-policy":
                invariant.disable()
        print(json.dumps(row), flush=True)  # each row as it comes: a timeout keeps the ones measured
        out.append(row)
    return out


def report(rows: list[dict], dtype: torch.dtype) -> list[str]:
    lines = [f"KL(engine ‖ trainer) per token, full vocabulary; engine {dtype} (one sequence a call), trainer "
             f"float32 master under autocast (whole batch, gradients on)", "",
             "| shape | forward | tokens | bf16 | rollout-fp8 | unified fp8 | rollout ÷ unified | unified, version 0 | "
             "unified engine, 1 vs all sequences a call | FP8 GEMMs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['forward']} | {r['tokens']} | refused: {r['error']} |||||||")
            continue
        ratio = "∞ (unified exactly 0)" if r["fp8"] == 0 else f"{r['rollout-fp8'] / r['fp8']:.3g}×"
        lines.append(f"| {r['shape']} | {r['forward']} | {r['tokens']} | {r['bf16']:.3e} | {r['rollout-fp8']:.3e} | "
                     f"{r['fp8']:.3e} | {ratio} | {r['fp8 version 0']:.3e} | {r['fp8 engine vs itself']:.3e} | {', '.join(r['fp8_paths']) or '—'} |")
    return lines


def run(shapes: list[str], checkpoint: str | None = None, invariant_too: bool = True,
        dtype: torch.dtype | None = None) -> tuple[list[str], list[dict]]:
    """The report's lines and rows; ``dtype``: the engine's (default bf16 on CUDA, float32 on
    the CPU, where bf16 reproduces CUDA's pairing with the CPU's kernels)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    rows = [r for s in shapes for r in measure(s, device, dtype, checkpoint if s == "countdown" else None,
                                                invariant_too)]
    return report(rows, dtype), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["countdown", "h96", "h1024"])
    ap.add_argument("--checkpoint", default=None, help="weights for the countdown shape (e.g. runs/countdown/sft)")
    ap.add_argument("--no-invariant", action="store_true", help="the default kernels only")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="the engine's (default: the device's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lines, rows = run(args.shapes, args.checkpoint, not args.no_invariant, args.dtype and getattr(torch, args.dtype))
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
