"""A run through Ray on a BOS tokenizer: the prompt ids the trainer trained on (the
trajectory dump) are ``transformers.AutoTokenizer``'s encoding of the prompts, BOS included.

The tokenizer is Llama-style (its post-processor prepends ``<s>``), built here and saved
beside a tiny model as a checkpoint ships it; the unit tests (tests/unit/models/
test_prompt_tokens.py) cover the encoding itself, this covers the path from the prompt file
through the dataset, the buffer and the rollout workers to the trained batch.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from miles.config import resolve
from miles.driver import train
from tests.integration.conftest import read_jsonl, run_flags

transformers = pytest.importorskip("transformers")

PROMPTS = ["count down from 412 to 400:", "say 3:", "  two  spaces\nand a line:"]


def _llama_checkpoint(path) -> str:
    """A tiny Qwen3-shaped model with a byte-level BPE tokenizer that adds BOS (``<s>``)."""
    from miles.models import CausalLM, save_pretrained, tiny_config

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [("s", "a"), ("sa", "y"), ("Ġ", "t")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    torch.manual_seed(0)
    model = CausalLM(tiny_config(vocab_size=288, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.reset_parameters()
    save_pretrained(model, path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<unk>")
    fast.save_pretrained(str(path))
    return str(path)


def test_trained_prompt_ids_equal_transformers_encoding(ray_cluster, task, tmp_path) -> None:
    ckpt = _llama_checkpoint(tmp_path / "llama")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": p, "label": "3"}) + "\n" for p in PROMPTS))
    cfg = resolve(run_flags(ckpt, {**task, "data": str(data)}, tmp_path / "out", mode="sync", num_rollout=2,
                            rollout_batch_size=len(PROMPTS), n_samples_per_prompt=2, rollout_max_response_len=6))
    summary = asyncio.run(train(cfg))
    assert summary["status"] == "completed" and summary["ledger_ok"]
    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    want = {p: hf(p)["input_ids"] for p in PROMPTS}
    assert all(ids[0] == hf.bos_token_id for ids in want.values())
    rows = read_jsonl(tmp_path / "out" / "trajectories.jsonl")
    assert len(rows) == cfg.run.num_rollout * len(PROMPTS) * 2
    for row in rows:
        assert row["prompt_tokens"] == want[row["prompt"]], row["prompt"]
    assert {row["prompt"] for row in rows} == set(PROMPTS)
