"""PromptDataset: poisoned lines are skipped and counted (or fail with the line number);
the cursor survives a state_dict round trip; later epochs get new prompt ids."""

from __future__ import annotations

import json

import pytest

from miles.data import DataError, PromptDataset
from miles.models import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_poisoned_lines_skipped_and_counted(tmp_path, tok) -> None:
    path = _write(tmp_path / "d.jsonl", [
        json.dumps({"input": "good one", "label": 1}),
        "{broken",
        json.dumps(["not", "an", "object"]),
        json.dumps({"prompt": "wrong key"}),
        json.dumps({"input": ""}),
        json.dumps({"input": "x" * 500}),
        json.dumps({"input": 42}),
        "",
        json.dumps({"input": "good two", "metadata": {"k": 1}}),
    ])
    ds = PromptDataset(path, tokenizer=tok, max_prompt_len=100)
    assert len(ds) == 2
    assert dict(ds.skipped) == {"malformed_json": 2, "missing_input_key": 1, "empty_prompt": 1,
                                "prompt_too_long": 1, "bad_prompt": 1}
    assert ds.stats()["data/skipped/malformed_json"] == 2


def test_fail_mode_names_the_line(tmp_path, tok) -> None:
    path = _write(tmp_path / "d.jsonl", [json.dumps({"input": "ok"}), json.dumps({"q": 1})])
    with pytest.raises(DataError, match=r"d.jsonl:2: missing_input_key"):
        PromptDataset(path, tokenizer=tok, on_bad_data="fail")


def test_no_usable_rows_and_missing_file(tmp_path, tok) -> None:
    with pytest.raises(DataError, match="no usable rows"):
        PromptDataset(_write(tmp_path / "d.jsonl", ["{bad"]), tokenizer=tok)
    with pytest.raises(DataError, match="file not found"):
        PromptDataset(tmp_path / "nope.jsonl", tokenizer=tok)


def test_cursor_epochs_and_resume(tmp_path, tok) -> None:
    path = _write(tmp_path / "d.jsonl", [json.dumps({"input": f"q{i}"}) for i in range(3)])
    ds = PromptDataset(path, tokenizer=tok, shuffle=True, seed=3)
    first = [p.prompt_id for p in ds.next(4)]
    assert len(set(first)) == 4 and first[3].startswith("e1-")
    state = ds.state_dict()
    rest = [p.prompt_id for p in ds.next(5)]
    again = PromptDataset(path, tokenizer=tok, shuffle=True, seed=3)
    again.load_state_dict(state)
    assert [p.prompt_id for p in again.next(5)] == rest
    other = PromptDataset(_write(tmp_path / "e.jsonl", [json.dumps({"input": "a"})]), tokenizer=tok)
    with pytest.raises(DataError, match="rows"):
        other.load_state_dict(state)


def test_chat_template(tmp_path, tok) -> None:
    path = _write(tmp_path / "d.jsonl", [json.dumps({"input": [{"role": "user", "content": "hi"}]})])
    ds = PromptDataset(path, tokenizer=tok, apply_chat_template=True)
    (row,) = ds.next(1)
    assert row.prompt.startswith("<|im_start|>user\nhi<|im_end|>")
    assert row.prompt_tokens[0] == 3 and row.prompt_tokens == tok.encode(row.prompt)  # <|im_start|> is one token


def test_unusable_rows_say_why_and_token_ids_must_fit_the_model(tmp_path, tok) -> None:
    """Token ids the model's embedding lacks (a tokenizer larger than the checkpoint's vocab)
    are a skip reason; chat messages without --apply-chat-template get a hint; a file with
    no usable rows names each reason's first line, not only the counts."""
    path = _write(tmp_path / "d.jsonl", [
        json.dumps({"input": "hello"}),
        json.dumps({"input": [{"role": "user", "content": "hi"}]}),
        json.dumps({"input": "ok"}),
    ])
    ids = tok.encode("hello")
    ds = PromptDataset(path, tokenizer=tok, vocab_size=max(ids) + 1)
    assert len(ds) == 2 and dict(ds.skipped) == {"bad_prompt": 1}  # both text prompts fit
    small = min(max(ids), max(tok.encode("ok")))  # an embedding too small for both prompts
    with pytest.raises(DataError) as err:
        PromptDataset(path, tokenizer=tok, vocab_size=small)
    message = str(err.value)
    assert "has no usable rows" in message
    assert "token_outside_vocab=2 (first: line 1: token id" in message and f"vocab_size {small}" in message
    assert "bad_prompt=1 (first: line 2: the prompt is a list of chat messages: add --apply-chat-template)" in message
