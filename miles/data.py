"""Prompt data: JSONL in slime's format, read once, served in order with a resumable cursor.

Each line is a JSON object; ``--input-key`` names the prompt (a string, or a list of chat
messages when ``--apply-chat-template`` is set; ids as ``Tokenizer.encode_prompt`` gives
them, BOS included where the checkpoint's tokenizer adds one), ``--label-key`` the label handed to the
reward function, ``--metadata-key`` free metadata. Bad lines (malformed JSON, missing input,
empty prompt, prompt longer than ``--max-prompt-len`` tokens, a token id the model's
embedding does not have) are skipped and counted by reason, with the first line of each
reason kept for the message, or stop the run with the line number when ``--on-bad-data
fail``.

Prompt ids are ``e{epoch}-l{line}``: the same line in a later epoch is a new prompt, so the
replay buffer's ledger never sees a duplicate.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

from miles.types import PromptSample


class DataError(ValueError):
    """Prompt data cannot be used; the message names the file and line."""


class TextTokenizer(Protocol):
    def encode_prompt(self, text: str, *, chat: bool = False, add_special_tokens: bool | None = None) -> list[int]: ...


def _encode_prompt(raw: Any, tokenizer: TextTokenizer | None, chat: bool,
                   special: bool | None = None) -> tuple[str, list[int]]:
    if chat:
        if isinstance(raw, str):
            raw = [{"role": "user", "content": raw}]
        if not isinstance(raw, list) or tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError("chat template needs a message list and a tokenizer with a chat template")
        rendered = tokenizer.apply_chat_template(raw)
        if isinstance(rendered, list):
            return json.dumps(raw), [int(t) for t in rendered]
        return rendered, tokenizer.encode_prompt(rendered, chat=True, add_special_tokens=special)
    if isinstance(raw, list) and raw and all(isinstance(m, dict) and "role" in m for m in raw):
        raise ValueError("the prompt is a list of chat messages: add --apply-chat-template")
    if not isinstance(raw, str):
        raise ValueError(f"expected a string prompt, got {type(raw).__name__}")
    return raw, (tokenizer.encode_prompt(raw, add_special_tokens=special) if tokenizer is not None else [])


class PromptDataset:
    """All usable rows of a JSONL file, and a cursor (epoch, position) over them."""

    def __init__(
        self,
        path: str | Path,
        *,
        tokenizer: TextTokenizer | None,
        input_key: str = "input",
        label_key: str | None = "label",
        metadata_key: str | None = "metadata",
        apply_chat_template: bool = False,
        add_special_tokens: bool | None = None,
        max_prompt_len: int | None = None,
        vocab_size: int | None = None,
        on_bad_data: str = "skip",
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"prompt data {str(self.path)!r}: file not found")
        self.shuffle = shuffle
        self.seed = seed
        self.skipped: Counter[str] = Counter()
        self.first_skip: dict[str, str] = {}  # reason → "line N: detail" of its first line
        self.rows: list[tuple[int, PromptSample]] = []
        with open(self.path, encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = self._parse(line, line_no, tokenizer, input_key, label_key, metadata_key,
                                      apply_chat_template, add_special_tokens, max_prompt_len, vocab_size)
                except _BadLine as bad:
                    if on_bad_data == "fail":
                        raise DataError(f"{self.path}:{line_no}: {bad.reason}: {bad.detail}") from None
                    self.skipped[bad.reason] += 1
                    self.first_skip.setdefault(bad.reason, f"line {line_no}: {bad.detail}")
                    continue
                self.rows.append((line_no, row))
        if not self.rows:
            raise DataError(f"prompt data {str(self.path)!r} has no usable rows "
                            f"({self.skip_summary() or 'the file is empty'})")
        self.epoch = 0
        self.position = 0
        self._order = self._make_order()

    def skip_summary(self) -> str:
        """The skipped lines by reason, each with its first line's detail ('' when none)."""
        return "; ".join(f"{reason}={n} (first: {self.first_skip[reason]})" for reason, n in self.skipped.items())

    @staticmethod
    def _parse(line: str, line_no: int, tokenizer: TextTokenizer | None, input_key: str,
               label_key: str | None, metadata_key: str | None, chat: bool, special: bool | None,
               max_len: int | None, vocab_size: int | None) -> PromptSample:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _BadLine("malformed_json", str(exc)) from None
        if not isinstance(obj, dict):
            raise _BadLine("malformed_json", "a line must be a JSON object")
        if input_key not in obj:
            raise _BadLine("missing_input_key", f"no key {input_key!r} (keys: {sorted(obj)[:8]})")
        raw = obj[input_key]
        if raw is None or (isinstance(raw, (str, list)) and len(raw) == 0):
            raise _BadLine("empty_prompt", f"key {input_key!r} is empty")
        try:
            text, tokens = _encode_prompt(raw, tokenizer, chat, special)
        except ValueError as exc:
            raise _BadLine("bad_prompt", str(exc)) from None
        if tokenizer is not None and not tokens:
            raise _BadLine("empty_prompt", "the prompt encodes to no tokens")
        if max_len is not None and len(tokens) > max_len:
            raise _BadLine("prompt_too_long", f"{len(tokens)} tokens > --max-prompt-len {max_len}")
        if vocab_size is not None and tokens and max(tokens) >= vocab_size:
            raise _BadLine("token_outside_vocab", f"token id {max(tokens)} >= the model's vocab_size {vocab_size} "
                           "(the tokenizer has more tokens than the checkpoint's embedding)")
        metadata = obj.get(metadata_key) if metadata_key else None
        if metadata is not None and not isinstance(metadata, dict):
            metadata = {"value": metadata}
        return PromptSample(
            prompt_id=f"l{line_no}",
            prompt=text,
            prompt_tokens=tokens,
            label=obj.get(label_key) if label_key else None,
            metadata=metadata or {},
        )

    def _make_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.rows)

    def next(self, n: int) -> list[PromptSample]:
        """The next ``n`` prompts, wrapping into a new epoch (with new prompt ids)."""
        out: list[PromptSample] = []
        while len(out) < n:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._make_order()
            _, row = self.rows[self._order[self.position]]
            self.position += 1
            out.append(PromptSample(
                prompt_id=f"e{self.epoch}-{row.prompt_id}",
                prompt=row.prompt,
                prompt_tokens=list(row.prompt_tokens),
                label=row.label,
                metadata=dict(row.metadata),
            ))
        return out

    def all(self) -> list[PromptSample]:
        """Every row once (evaluation sets)."""
        return [row for _, row in self.rows]

    def stats(self) -> dict[str, float]:
        out = {"data/rows": float(len(self.rows)), "data/epoch": float(self.epoch)}
        out.update({f"data/skipped/{k}": float(v) for k, v in self.skipped.items()})
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_rows") != len(self.rows):
            raise DataError(
                f"checkpoint data cursor was for {state.get('num_rows')} rows, {self.path} has {len(self.rows)}"
            )
        self.epoch = int(state["epoch"])
        self._order = self._make_order()
        self.position = int(state["position"])


class _BadLine(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail
