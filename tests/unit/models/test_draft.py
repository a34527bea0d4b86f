"""Draft models: HF-style checkpoints of both kinds round-trip (and fail loudly on a
mismatch), the default configs fit the policy, and the EAGLE head's cached forward equals
its full forward."""

from __future__ import annotations

import json

import pytest
import torch

from miles.models import CheckpointError, tiny_config
from miles.models.draft import EagleHead, build_draft, check_compatible, draft_lm_config, load_draft, save_draft


@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_checkpoint_roundtrip(tmp_path, kind: str) -> None:
    policy = tiny_config()
    draft = build_draft(kind, policy, seed=4)
    save_draft(draft, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert (hf["architectures"] == ["MilesEagleHead"]) == (kind == "eagle")
    loaded = load_draft(tmp_path)
    assert type(loaded) is type(draft)
    for (k, a), (k2, b) in zip(sorted(draft.state_dict().items()), sorted(loaded.state_dict().items())):
        assert k == k2 and torch.equal(a, b)
    check_compatible(loaded, policy)


def test_eagle_checkpoint_mismatch_names_the_tensor(tmp_path) -> None:
    head = build_draft("eagle", tiny_config())
    save_draft(head, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["hidden_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="model.fc.weight"):
        load_draft(tmp_path)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_draft(tmp_path / "missing")


def test_configs_fit_the_policy() -> None:
    policy = tiny_config(moe=True)
    lm = draft_lm_config(policy, num_layers=2, hidden_size=128)
    assert lm.vocab_size == policy.vocab_size and not lm.is_moe and lm.num_hidden_layers == 2
    assert lm.hidden_size == 128 and lm.num_attention_heads * lm.head_dim == 128
    head = build_draft("eagle", policy)
    assert head.config.hidden_size == policy.hidden_size and not head.config.is_moe
    with pytest.raises(ValueError, match="vocab_size"):
        check_compatible(build_draft("draft", tiny_config(vocab_size=300)), policy)
    with pytest.raises(ValueError, match="not in"):
        build_draft("ngram", policy)


def test_eagle_head_feature_is_causal() -> None:
    torch.manual_seed(0)
    head = EagleHead(tiny_config(num_hidden_layers=1))
    embed = torch.nn.Embedding(288, 64)
    h, ids = torch.randn(1, 9, 64), torch.randint(0, 288, (1, 9))
    full = head(h, ids, embed)
    prefix = head(h[:, :5], ids[:, :5], embed)
    assert torch.allclose(full[:, :5], prefix, atol=1e-5)  # entry t sees entries <= t only


def test_eagle_head_trains_on_sequences_past_the_default_rope_table() -> None:
    """The head's table starts at 8192 positions; a longer trajectory in draft training
    gathered past its end (a device-side assert on CUDA). A full pass grows it, and the
    prefix of a long pass equals the short pass."""
    torch.manual_seed(0)
    head = EagleHead(tiny_config(num_hidden_layers=1, max_position_embeddings=10000))
    embed = torch.nn.Embedding(288, 64)
    n = 8300
    h, ids = torch.randn(1, n, 64), torch.randint(0, 288, (1, n))
    with torch.no_grad():
        full = head(h, ids, embed)
        prefix = head(h[:, :16], ids[:, :16], embed)
    assert full.shape == (1, n, 64) and torch.isfinite(full).all()
    assert torch.allclose(full[:, :16], prefix, atol=1e-5)
