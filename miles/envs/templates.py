"""Turn templates: the text placed between two model turns, around an observation.

An episode's context is ``prompt · action₁ · obs₁ · action₂ · obs₂ · …``: the actions are
the model's tokens exactly as sampled, and each ``obsᵢ`` is the environment's text wrapped
by a turn template, tokenized once and appended as it is (never re-tokenized later).

Three templates (``--env-turn-template``):

- ``chat``: derived from the tokenizer's chat template. Rendering the conversation
  ``[user "·", assistant A, ROLE O]`` with the generation prompt and cutting it at the
  sentinels ``A`` and ``O`` gives ``close`` (what ends an assistant turn and opens the
  ROLE message) and ``open`` (what ends that message and opens the next assistant turn);
  for ChatML: ``close = "<|im_end|>\\n<|im_start|>user\\n"``,
  ``open = "<|im_end|>\\n<|im_start|>assistant\\n"``. When the model ended its turn with a
  stop token or stop string that ``close`` begins with (Qwen's ``<|im_end|>``), that part
  is not written twice. The result is what the chat template itself renders for the same
  conversation, up to how the model's own text was tokenized.
- ``raw``: the observation text as is (tool output inlined in one assistant message, as
  Search-R1 / ReTool style prompts do).
- a custom string containing ``{observation}``, e.g. ``"\\n<result>{observation}</result>\\n"``
  (plain substitution: other braces are kept literally).

The first observation (``Env.reset``), when not empty, is the episode's prompt: in chat
mode a user message (or the message list ``reset`` returned) rendered with the
generation prompt; in the other modes the text as is.
"""

from __future__ import annotations

import json
from typing import Any

_ASSISTANT = "\u2063ASSISTANT_SENTINEL\u2063"
_OBSERVATION = "\u2063OBSERVATION_SENTINEL\u2063"


class TemplateError(ValueError):
    """The turn template cannot be built or used; the message says what to set instead."""


class TurnTemplate:
    def __init__(self, mode: str, *, tokenizer: Any = None, role: str = "user") -> None:
        self.mode = mode
        self.role = role
        self.tokenizer = tokenizer
        self.close = self.open = ""
        if mode == "chat":
            self.close, self.open = chat_separators(tokenizer, role)
        elif mode != "raw" and "{observation}" not in mode:
            raise TemplateError(f"turn template {mode!r}: expected 'chat', 'raw' or a string with '{{observation}}'")

    def observation_text(self, observation: str, *, after: str | None = None) -> str:
        """The text to append after a model turn that ended with ``after`` (the matched
        stop string, or the decoded stop token; None when the turn hit its length)."""
        if self.mode == "raw":
            return observation
        if self.mode != "chat":
            return self.mode.replace("{observation}", observation)
        close = self.close
        if after and close.startswith(after):
            close = close[len(after):]
        return close + observation + self.open

    def prompt_text(self, first: str | list[dict[str, Any]]) -> str:
        """The prompt for an episode whose ``reset`` returned ``first`` (not empty)."""
        if self.mode == "chat":
            messages = [{"role": "user", "content": first}] if isinstance(first, str) else first
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return str(rendered)
        if not isinstance(first, str):
            raise TemplateError(f"reset returned a message list, which needs --env-turn-template chat (got {self.mode!r})")
        return first


def chat_separators(tokenizer: Any, role: str) -> tuple[str, str]:
    """``(close, open)`` around a ``role`` message after an assistant turn (see module doc)."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise TemplateError(
            "--env-turn-template chat needs a tokenizer with a chat template; this checkpoint has none "
            "(use --env-turn-template raw, or a string with '{observation}')"
        )
    messages = [
        {"role": "user", "content": "\u2063"},
        {"role": "assistant", "content": _ASSISTANT},
        {"role": role, "content": _OBSERVATION},
    ]
    try:
        text = str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    except Exception as exc:
        raise TemplateError(
            f"the chat template cannot render a {role!r} message after an assistant turn ({exc}); "
            "set --env-observation-role or --env-turn-template"
        ) from exc
    a, o = text.find(_ASSISTANT), text.find(_OBSERVATION)
    if a < 0 or o < 0 or o < a:
        raise TemplateError(
            f"the chat template does not render a {role!r} message's content verbatim; "
            "set --env-turn-template to a string with '{observation}'"
        )
    return text[a + len(_ASSISTANT): o], text[o + len(_OBSERVATION):]


def stop_text(tokenizer: Any, matched_stop: int | str | None) -> str | None:
    """The text of the stop that ended a turn (a token id is decoded with specials kept)."""
    if matched_stop is None:
        return None
    if isinstance(matched_stop, str):
        return matched_stop
    try:
        return tokenizer.decode([matched_stop], skip_special_tokens=False)
    except Exception:
        return None


def fingerprint(value: str | list[dict[str, Any]]) -> str:
    """A short stable digest of an observation (replay checks that an Env repeats itself)."""
    import hashlib

    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
