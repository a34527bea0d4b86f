"""Turn templates: separators from the chat template, raw and custom forms, clear errors."""

from __future__ import annotations

import pytest

from miles.envs import TemplateError, TurnTemplate, chat_separators
from miles.envs.templates import stop_text
from miles.models import Tokenizer, build_tiny_tokenizer

TOK = build_tiny_tokenizer()

# A Qwen-style template written for this test: a system line, tool results inside a user
# turn, and a "thinking" block on the last assistant message only (so an assistant turn
# renders differently when it is last — the separators must not depend on that).
QWEN_LIKE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' and loop.last %}<|im_start|>assistant\n<think>\n\n</think>\n\n"
    "{{ m['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _with_template(template: str | None) -> Tokenizer:
    tok = build_tiny_tokenizer()
    tok.chat_template = template
    return tok


def test_chatml_separators_reproduce_the_chat_template() -> None:
    close, open_ = chat_separators(TOK, "user")
    assert (close, open_) == ("<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    t = TurnTemplate("chat", tokenizer=TOK)
    # prompt + action + observation renders as the template renders the conversation
    convo = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "A"},
             {"role": "user", "content": "higher"}]
    expected = TOK.apply_chat_template(convo, add_generation_prompt=True)
    # the model ended its turn with <|im_end|> (Qwen's EOS): it is not written twice
    got = t.prompt_text("go") + "A<|im_end|>" + t.observation_text("higher", after="<|im_end|>")
    assert got == expected
    got = t.prompt_text("go") + "A" + t.observation_text("higher", after=None)
    assert got == expected


def test_tool_role_with_a_qwen_like_template() -> None:
    t = TurnTemplate("chat", tokenizer=_with_template(QWEN_LIKE), role="tool")
    assert t.observation_text("42", after="</tool_call>") == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert t.observation_text("42", after="<|im_end|>").startswith("\n<|im_start|>user\n<tool_response>")


def test_prompt_from_messages_and_strings() -> None:
    t = TurnTemplate("chat", tokenizer=TOK)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert t.prompt_text(msgs) == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    assert TurnTemplate("raw").prompt_text("as is") == "as is"
    with pytest.raises(TemplateError, match="needs --env-turn-template chat"):
        TurnTemplate("raw").prompt_text(msgs)


def test_raw_and_custom() -> None:
    assert TurnTemplate("raw").observation_text("x", after="<eos>") == "x"
    custom = TurnTemplate('\n<obs json="{}">{observation}</obs>\n')
    assert custom.observation_text("x") == '\n<obs json="{}">x</obs>\n'


def test_bad_templates_say_what_to_do() -> None:
    with pytest.raises(TemplateError, match="needs a tokenizer with a chat template"):
        TurnTemplate("chat", tokenizer=_with_template(None))
    with pytest.raises(TemplateError, match="does not render"):
        TurnTemplate("chat", tokenizer=_with_template("{% for m in messages %}[{{ m['role'] }}]{% endfor %}"))
    with pytest.raises(TemplateError, match="cannot render"):
        TurnTemplate("chat", tokenizer=_with_template("{{ raise_exception('no tools here') }}"), role="tool")
    with pytest.raises(TemplateError, match="expected 'chat', 'raw'"):
        TurnTemplate("nonsense")


def test_stop_text() -> None:
    im_end = TOK.backend.token_to_id("<|im_end|>")
    assert stop_text(TOK, im_end) == "<|im_end|>"
    assert stop_text(TOK, "</tool_call>") == "</tool_call>"
    assert stop_text(TOK, None) is None
