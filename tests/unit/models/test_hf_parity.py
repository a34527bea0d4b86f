"""Our CausalLM against transformers on the same random checkpoint (float32, CPU).

Tolerance: max |Δlogit| < 1e-5 (observed: 0.0 — bitwise — for unpadded inputs, ~3e-7 with
left padding where the two build their masks differently). Weights use std 0.1 so that
logits spread over several units and the comparison is not trivially small.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from miles.models import CausalLM, load_pretrained, save_pretrained, tiny_config  # noqa: E402

TOL = 1e-5
VARIANTS = {
    "qwen3": dict(),
    "qwen3_tied": dict(tie_word_embeddings=True),
    "qwen3_moe": dict(moe=True),
    "qwen3_moe_mixed": dict(moe=True, norm_topk_prob=False, mlp_only_layers=[0]),
    "qwen2_moe_shared": dict(moe=True, model_type="qwen2_moe", shared_expert_intermediate_size=48,
                             attention_bias=True),
    "llama3_rope": dict(model_type="llama", attention_bias=True,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64}),
    # YaRN as long-context Qwen3 checkpoints ship it (factor 4 over a 32-token original
    # context, so the 40-token inputs below run past it), and DeepSeek-style mscale terms
    "qwen3_yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen3_yarn_mscale": dict(rope_scaling={"rope_type": "yarn", "factor": 8.0, "mscale": 0.707,
                                            "mscale_all_dim": 1.0, "beta_fast": 16,
                                            "original_max_position_embeddings": 16}),
}
HF_CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _pair(tmp_path, **kw):
    torch.manual_seed(0)
    model = CausalLM(tiny_config(initializer_range=0.1, **kw)).eval()
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    return load_pretrained(tmp_path), hf  # through our loader too (it builds on the meta device)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(tmp_path, name: str) -> None:
    model, hf = _pair(tmp_path, **VARIANTS[name])
    expected_cls = HF_CLASSES.get(model.config.model_type)
    if expected_cls:
        assert type(hf).__name__ == expected_cls
    ids = torch.randint(0, model.config.vocab_size, (3, 40))
    with torch.no_grad():
        ours, theirs = model(ids).logits, hf(ids).logits
    assert ours.abs().max() > 1.0  # a meaningful comparison, not two near-zero tensors
    assert (ours - theirs).abs().max().item() < TOL
    # Left padding, as HF batches prompts.
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[1, :2] = 0
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max().item() < TOL


def test_moe_routing_matches_transformers_router(tmp_path) -> None:
    model, hf = _pair(tmp_path, moe=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        out = model(ids, return_routing=True)
        theirs = hf(ids, output_router_logits=True).router_logits
    assert out.routing.shape == (2, 16, len(model.moe_layers), model.config.num_experts_per_tok)
    for layer, logits in enumerate(theirs):
        top = torch.topk(logits.softmax(-1), model.config.num_experts_per_tok, dim=-1).indices
        assert torch.equal(out.routing[:, :, layer].reshape(-1, top.shape[-1]), top)


def test_transformers_saved_checkpoint_loads(tmp_path) -> None:
    """A checkpoint written by transformers itself (its on-disk naming) loads into ours."""
    cfg = tiny_config(moe=True, initializer_range=0.1)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        assert (model(ids).logits - hf(ids).logits).abs().max().item() < TOL
