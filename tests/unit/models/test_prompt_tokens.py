"""Prompt ids as ``transformers`` encodes them: a Llama-style tokenizer (its post-processor
adds BOS) and a Qwen-style one (none), both built locally and loaded by both libraries;
raw text, chat templates, and the ``--add-special-tokens`` override, through PromptDataset."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from miles.data import PromptDataset
from miles.models import load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["Using numbers [3, 5, 7], make 8.", "hello world", "  two  spaces\nand a line"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level(specials: list[str]) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def _save(path, tok: Tokenizer, cfg: dict) -> str:
    """tokenizer.json + tokenizer_config.json, as a checkpoint ships them."""
    path.mkdir(parents=True, exist_ok=True)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **cfg)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    tok = _byte_level(["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return _save(tmp_path_factory.mktemp("llama"), tok, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    tok = _byte_level(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return _save(tmp_path_factory.mktemp("qwen"), tok, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})


def _hf_chat_ids(hf, messages) -> list[int]:
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize(("which", "bos"), [("llama_dir", "<s>"), ("qwen_dir", None)])
def test_prompt_ids_match_transformers(request, which, bos) -> None:
    path = request.getfixturevalue(which)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    ours = load_tokenizer(path)
    for text in TEXTS:
        want = hf(text)["input_ids"]
        got = ours.encode_prompt(text)
        assert got == want, text
        assert (got[0] == hf.convert_tokens_to_ids(bos)) if bos else (got == hf(text, add_special_tokens=False)["input_ids"])
    rendered = ours.apply_chat_template(MESSAGES)
    assert rendered == hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ours.encode_prompt(rendered, chat=True) == _hf_chat_ids(hf, MESSAGES)
    assert ours.apply_chat_template(MESSAGES, tokenize=True) == _hf_chat_ids(hf, MESSAGES)


def _data(tmp_path, rows) -> str:
    path = tmp_path / f"d{len(list(tmp_path.iterdir()))}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dataset_default_and_override(tmp_path, llama_dir, qwen_dir) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(llama_dir)
    tok = load_tokenizer(llama_dir)
    raw = _data(tmp_path, [{"input": t} for t in TEXTS])
    ds = PromptDataset(raw, tokenizer=tok)
    assert [s.prompt_tokens for _, s in ds.rows] == [hf(t)["input_ids"] for t in TEXTS]
    assert all(s.prompt_tokens[0] == tok.bos_token_id for _, s in ds.rows)
    off = PromptDataset(raw, tokenizer=tok, add_special_tokens=False)
    assert [s.prompt_tokens for _, s in off.rows] == [hf(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    # a chat prompt: the template's own BOS once, not a second one from the post-processor
    chat = _data(tmp_path, [{"input": MESSAGES}])
    (_, row), = PromptDataset(chat, tokenizer=tok, apply_chat_template=True).rows
    assert row.prompt_tokens == _hf_chat_ids(hf, MESSAGES)
    assert row.prompt_tokens[:2] != [tok.bos_token_id] * 2
    (_, forced), = PromptDataset(chat, tokenizer=tok, apply_chat_template=True, add_special_tokens=True).rows
    assert forced.prompt_tokens == [tok.bos_token_id] + row.prompt_tokens
    # Qwen-style: nothing is added either way it is asked
    qwen = load_tokenizer(qwen_dir)
    qhf = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    q = PromptDataset(raw, tokenizer=qwen)
    assert [s.prompt_tokens for _, s in q.rows] == [qhf(t)["input_ids"] for t in TEXTS]
