"""Tokenizer: a thin wrapper over ``tokenizers.Tokenizer`` (tokenizer.json), no hub, no transformers.

``load_tokenizer(dir)`` reads ``tokenizer.json`` plus, when present, ``tokenizer_config.json``
(eos / pad / bos tokens, ``chat_template``) and ``chat_template.jinja`` (where transformers 5
writes the template). ``build_tiny_tokenizer()`` makes the deterministic byte-level tokenizer
the CPU examples and tests use: special tokens first (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2,
``<|im_start|>`` 3, ``<|im_end|>`` 4), then the 256 bytes in byte order, so every string
round-trips and ids never depend on the machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

TINY_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<eos>", "lstrip": ..., ...}
        return value.get("content")
    return value


class Tokenizer:
    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        eos_token: str | None = None,
        pad_token: str | None = None,
        bos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = tokenizer
        self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, bos_token
        self.chat_template = chat_template
        self.eos_token_id = self._id(eos_token)
        self.pad_token_id = self._id(pad_token)
        self.bos_token_id = self._id(bos_token)
        self._template: Any = None

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self.backend.token_to_id(token)
        if tid is None:
            raise ValueError(f"special token {token!r} is not in the vocabulary")
        return tid

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str, *, chat: bool = False, add_special_tokens: bool | None = None) -> list[int]:
        """A prompt's ids as ``transformers`` encodes it by default: raw text through the
        tokenizer's post-processor (a BOS where it adds one, as the checkpoint's SFT data
        had), a rendered chat template as it is (the template writes its own BOS, and
        ``apply_chat_template(tokenize=True)`` adds none). ``add_special_tokens`` overrides
        either (``--add-special-tokens`` / ``--no-add-special-tokens``)."""
        special = (not chat) if add_special_tokens is None else add_special_tokens
        return self.encode(text, add_special_tokens=special)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the checkpoint's Jinja chat template (sandboxed)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            eos_token=self.eos_token,
            bos_token=self.bos_token,
            **kwargs,
        )
        return self.encode(text) if tokenize else text

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key in ("eos_token", "pad_token", "bos_token", "chat_template"):
            if getattr(self, key) is not None:
                cfg[key] = getattr(self, key)
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def _raise(message: str) -> None:
    raise ValueError(message)


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json")
    cfg: dict[str, Any] = {}
    if (path / "tokenizer_config.json").is_file():
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    template = cfg.get("chat_template")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return Tokenizer(
        _HFTokenizer.from_file(str(file)),
        eos_token=_token_text(cfg.get("eos_token")),
        pad_token=_token_text(cfg.get("pad_token")),
        bos_token=_token_text(cfg.get("bos_token")),
        chat_template=template,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what ByteLevel pre-tokenizes to)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def build_tiny_tokenizer(*, corpus: list[str] | None = None, vocab_size: int = 0) -> Tokenizer:
    """Byte-level tokenizer built locally: specials, then one token per byte (byte order).

    With ``corpus`` and ``vocab_size`` > 261 it also learns BPE merges on the corpus
    (deterministic for a given corpus), for examples that want shorter sequences.
    """
    byte_chars = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    for b in range(256):
        vocab[byte_chars[b]] = len(vocab)
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if corpus is not None and vocab_size > len(vocab):
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(TINY_SPECIAL_TOKENS),
            initial_alphabet=[byte_chars[b] for b in range(256)],
            show_progress=False,
        )
        tok = _HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    return Tokenizer(
        tok,
        eos_token="<eos>",
        pad_token="<pad>",
        bos_token="<bos>",
        chat_template=TINY_CHAT_TEMPLATE,
    )
