"""save_pretrained / load_pretrained: identity, sharding, HF names, strict errors; tokenizer IO."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles.models import (
    CausalLM,
    CheckpointError,
    build_tiny_tokenizer,
    load_pretrained,
    load_tokenizer,
    save_pretrained,
    tiny_config,
)


def _model(**kw) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(tiny_config(**kw)).eval()


@pytest.mark.parametrize("kw", [dict(), dict(moe=True), dict(tie_word_embeddings=True)])
def test_save_load_identity(tmp_path, kw) -> None:
    model = _model(**kw)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert loaded.config == model.config
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids = torch.randint(0, 200, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    if model.config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")


def test_hf_names_on_disk(tmp_path) -> None:
    save_pretrained(_model(moe=True), tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.q_norm.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.experts.7.down_proj.weight", "model.norm.weight",
                 "lm_head.weight"):
        assert name in names


def test_sharded_checkpoint(tmp_path) -> None:
    model = _model()
    save_pretrained(model, tmp_path, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.state_dict()["model.norm.weight"].float(), model.model.norm.weight)


def test_config_tensor_mismatch_is_named(tmp_path) -> None:
    save_pretrained(_model(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj\.weight' has shape"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\..*' is not part of"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['model\.layers\.2"):
        load_pretrained(tmp_path)


def test_missing_files(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf()))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_pretrained(tmp_path)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'x' is not part of"):
        load_pretrained(tmp_path)


def test_tiny_tokenizer_roundtrip_and_io(tmp_path) -> None:
    tok = build_tiny_tokenizer()
    text = "Hello, wörld! 12+30=42\n\tend"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size <= tiny_config().vocab_size
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok.encode("<eos>") == [1]
    assert tok.decode([5 + ord("a"), 1]) == "a"
    assert build_tiny_tokenizer().encode(text) == ids  # deterministic
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    save_pretrained(_model(), tmp_path, tokenizer=tok)
    again = load_tokenizer(tmp_path)
    assert again.encode(text) == ids and again.eos_token_id == 1
    assert again.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True) == tok.encode(chat)


def test_tiny_tokenizer_bpe_training_is_deterministic() -> None:
    corpus = ["12 + 34 = 46", "7 + 8 = 15", "100 + 200 = 300"] * 20
    a = build_tiny_tokenizer(corpus=corpus, vocab_size=280)
    b = build_tiny_tokenizer(corpus=corpus, vocab_size=280)
    assert a.encode("12 + 34 = 46") == b.encode("12 + 34 = 46")
    assert len(a.encode("12 + 34 = 46")) < len("12 + 34 = 46")
    assert a.decode(a.encode("100 + 7 = 107")) == "100 + 7 = 107"
    assert a.eos_token_id == 1


def test_load_tokenizer_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_check_checkpoint_reads_headers_only_and_names_the_problem(tmp_path) -> None:
    """``check_checkpoint`` (what the CLI runs before any actor starts) finds what
    ``load_pretrained`` would, from the safetensors headers alone; a config.json that is not
    JSON, or names an architecture miles cannot build, is a CheckpointError naming the file."""
    from miles.models import check_checkpoint

    save_pretrained(_model(), tmp_path)
    assert check_checkpoint(tmp_path) == _model().config
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 96}))
    with pytest.raises(CheckpointError, match=r"tensor '.*' has shape"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{'model_type': 'qwen3'}")  # not JSON
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match=r"config\.json: model_type 'gpt2' not in"):
        check_checkpoint(tmp_path)
    heads = ("num_attention_heads", "num_key_value_heads")
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in heads}))
    with pytest.raises(CheckpointError, match=r"config\.json: missing key 'num_attention_heads'"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        check_checkpoint(tmp_path)


def test_the_cli_checks_the_checkpoint_before_anything_starts(tmp_path) -> None:
    from miles.config import ConfigError, resolve

    save_pretrained(_model(), tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    (tmp_path / "d.jsonl").write_text('{"input": "x"}\n')
    vocab = cfg["vocab_size"]
    with pytest.raises(ConfigError, match=rf"--hf-checkpoint .*: model\.safetensors: tensor '.*' has shape \({vocab}, "
                                          r"64\), config\.json implies \(300, 64\)"):
        resolve({"hf_checkpoint": str(tmp_path / "ck"), "prompt_data": str(tmp_path / "d.jsonl"),
                 "custom_rm_path": "pkg.mod:fn"})
