"""Agent sessions: one episode's exact tokens, extended request by request.

A ``Session`` belongs to one sample (a ``Trajectory``) and holds its tokens as the engine saw
them: the first request's rendered prompt is the trajectory's prompt, every model output is
appended as a model segment (loss, behaviour log-probs, per-token versions straight from the
engine), and what the client adds between two calls — tool results, user turns, the
template's glue — is appended as an env segment (masked). A request whose messages extend
the stored history tokenizes only the new part; the model's earlier outputs are never
re-tokenized.

Drift: when a request's messages do not extend the history (edited or dropped messages, a
template that rewrites earlier turns, other tools), the tokens so far cannot be the context
of this request. The session then closes the current token segment, notes the drift in
``metadata["agent"]["drift"]`` and starts a new one from the request's own rendering. The
trained trajectory is the last segment (it holds the episode's final answer, which the
reward scores); earlier segments are kept in ``metadata["agent"]["segments"]`` with their
ids, masks and versions, and are not trained.

Every request runs through ``ctx.engine.generate`` like any other trajectory's, under the
trajectory's id: with ``--partial-rollout`` a weight update lands between two decode steps
and the tokens after it carry the new version; the buffer applies ``--max-staleness`` and
``--stale-policy`` per token when the episode is put back.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from typing import Any

from miles.agent.chat import AgentError, assistant_close, assistant_message, check_messages, render, same_history
from miles.envs.templates import stop_text
from miles.rollout import GenerateContext
from miles.types import GenerateOutput, Status, Trajectory

KEY = "agent"


class Turn:
    """What one model call produced, for the server to shape into a response."""

    __slots__ = ("finish_reason", "logprobs", "message", "prompt_tokens", "text", "token_ids", "tool_calls",
                 "versions")

    def __init__(self, out: GenerateOutput, text: str, prompt_tokens: int) -> None:
        self.token_ids, self.logprobs, self.versions = list(out.output_ids), list(out.logprobs), list(out.versions)
        self.text, self.prompt_tokens = text, prompt_tokens
        self.finish_reason = "length" if out.finish_reason == "length" else "stop"
        self.message: dict[str, Any] = {}
        self.tool_calls: list[dict[str, Any]] = []


class Session:
    def __init__(self, sid: str, sample: Trajectory, ctx: GenerateContext) -> None:
        self.id, self.sample, self.ctx = sid, sample, ctx
        self.tokenizer = ctx.tokenizer
        self.mode: str | None = None  # "chat" or "completions": how the stored tokens were built
        self.history: list[dict[str, Any]] = []  # chat: the normal-form messages the tokens cover
        self.tools: list[dict[str, Any]] | None = None
        self._close: str | None = None  # the template's assistant close for these tools
        self._rendered = ""  # chat: the last request's rendering (with its generation prompt)
        self.text = ""  # completions: the text the tokens cover
        self.after: str | None = None  # the stop text that ended the last model call
        self.ended = False
        self.aborted = False
        self.error: str | None = None  # an engine error: the episode fails with it
        self.last_finish: str | None = None
        self.cut = False  # the last call was cut by the episode's budget, not by its max_tokens
        self.calls = 0
        self.lock = asyncio.Lock()
        self.drift: list[dict[str, Any]] = []
        self.done_segments: list[dict[str, Any]] = []
        engine_ctx = getattr(getattr(ctx.engine, "config", None), "max_seq_len", None)
        self.context_limit = int(engine_ctx) if engine_ctx else 1 << 60
        _clear(sample)

    # ---- building the context ----------------------------------------------------------
    def chat_context(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        """Make the stored tokens the context of a chat request for ``messages``.

        The new messages start where the history's own rendering ends in the request's
        rendering. The usual turn (the history ends with the model's plain answer) finds
        that point without rendering the history again: it is the last request's rendering,
        the answer's text and the template's assistant close, when the new rendering starts
        with exactly that (then the stored tokens' text is the new rendering's start, which
        is all the append needs). Otherwise (tool calls, templates that rewrite an answer,
        e.g. dropping ``<think>``) the history is rendered to find it."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None) is None:
            raise AgentError(400, "this checkpoint's tokenizer has no chat template: use /v1/completions")
        k = len(self.history)
        if self.mode == "chat" and k and len(messages) > k and tools == self.tools \
                and same_history(messages[:k], self.history):
            full = render(tok, messages, tools, generation_prompt=True)
            if self._close is None:
                self._close = assistant_close(tok, tools)
            last = self.history[-1]
            prefix = self._rendered + last["content"] + self._close \
                if last["role"] == "assistant" and not last.get("tool_calls") else None
            if prefix is None or not full.startswith(prefix):
                prefix = render(tok, messages[:k], tools, generation_prompt=False)
            if full.startswith(prefix):
                close = self._close
                if self.after and close.startswith(self.after):
                    close = close[len(self.after):]  # the model wrote that part itself
                self._append_env(tok.encode(close + full[len(prefix):]))
                self.history, self._rendered = list(messages), full
                return
            reason = "the chat template renders the earlier turns differently once new messages follow"
        elif self.mode is None:
            reason = ""
        elif self.mode != "chat":
            reason = "a chat request after /v1/completions calls"
        elif tools != self.tools:
            reason = "the request's tools differ from the earlier requests'"
        else:
            reason = "the messages do not extend the session's history (edited, dropped or reordered)"
        text = render(tok, messages, tools, generation_prompt=True)
        self._start_segment(text, tok.encode(text), reason)
        self.mode, self.history, self.tools, self._close, self._rendered = "chat", list(messages), tools, None, text

    def completion_context(self, prompt: str | list[int]) -> None:
        """Make the stored tokens the context of a completions request for ``prompt``."""
        s = self.sample
        if self.mode == "completions":
            if isinstance(prompt, list) and len(prompt) > len(s.prompt_tokens) + len(s.response_tokens) \
                    and prompt[: len(s.prompt_tokens)] == s.prompt_tokens \
                    and prompt[len(s.prompt_tokens): len(s.prompt_tokens) + len(s.response_tokens)] == s.response_tokens:
                self._append_env(prompt[len(s.prompt_tokens) + len(s.response_tokens):])
                self.text = ""  # token ids from here on: texts are no longer compared
                return
            if isinstance(prompt, str) and self.text and len(prompt) > len(self.text) and prompt.startswith(self.text):
                self._append_env(self.tokenizer.encode(prompt[len(self.text):]))
                self.text = prompt
                return
            reason = "the prompt does not extend the previous prompt and completion"
        else:
            reason = "" if self.mode is None else "a completions request after chat requests"
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
        self._start_segment(text, ids, reason)
        self.mode, self.text = "completions", prompt if isinstance(prompt, str) else ""

    def _append_env(self, ids: list[int]) -> None:
        if len(ids) + 1 > self.room():
            raise AgentError(400, f"the episode's context is full: {len(ids)} new tokens leave no room to "
                                  f"generate ({self.room()} left)", kind="context_length_exceeded")
        self.sample.append(ids, [0.0] * len(ids), self.ctx.engine.version, kind="env")

    def _start_segment(self, text: str, ids: list[int], reason: str) -> None:
        s = self.sample
        if not ids:
            raise AgentError(400, "the prompt renders to no tokens", param="messages")
        if len(ids) >= self.context_limit:
            raise AgentError(400, f"the prompt has {len(ids)} tokens; the context holds {self.context_limit}",
                             kind="context_length_exceeded")
        if self.mode is not None:  # drift: keep the old segment aside, untrained
            self.drift.append({"call": self.calls, "segment": len(self.done_segments) + 1, "reason": reason})
            self.done_segments.append(_segment_record(s))
            _clear(s)
        s.prompt, s.prompt_tokens = text, list(ids)

    def room(self) -> int:
        """Tokens the episode may still add (the engine's context, --rollout-max-response-len)."""
        s = self.sample
        return min(self.context_limit - len(s.prompt_tokens) - len(s.response_tokens),
                   self.ctx.max_response_len - len(s.response_tokens))

    # ---- one model call ----------------------------------------------------------------
    async def generate(self, *, max_tokens: int | None, stop: list[str], overrides: dict[str, Any],
                       parse_tools: bool) -> Turn:
        s, ctx = self.sample, self.ctx
        room = budget = self.room()
        if max_tokens is not None:
            budget = min(budget, max_tokens)
        base = ctx.sampling
        request = ctx.request_for(s, max_new_tokens=max(budget, 0), stop=list(dict.fromkeys([*base.stop, *stop])),
                                  **overrides)
        prompt_len = len(request.input_ids)
        self.calls += 1
        if budget <= 0:  # nothing more fits: an empty, length-limited answer (as OpenAI servers do)
            out = GenerateOutput(rid=s.id, finish_reason="length")
        else:
            out = await ctx.engine.generate(request)
        s.append(out.output_ids, out.logprobs, out.versions, kind="model")
        if out.finish_reason == "abort":
            self.aborted = True
            raise AgentError(503, "the episode was aborted (the rollout worker is stopping or parking its work)",
                             kind="aborted")
        if out.finish_reason == "error":
            self.error = str(out.error)
            raise AgentError(500, f"the engine failed: {out.error}", kind="engine_error")
        self.after = stop_text(self.tokenizer, out.matched_stop) if out.finish_reason == "stop" else None
        self.last_finish = out.finish_reason
        self.cut = out.finish_reason == "length" and len(out.output_ids) >= room
        text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        if isinstance(out.matched_stop, str) and text.endswith(out.matched_stop):
            text = text[: -len(out.matched_stop)]  # OpenAI servers leave the stop string out
        turn = Turn(out, text, prompt_len)
        if self.mode == "chat":
            turn.message, turn.tool_calls = assistant_message(text, parse_tools=parse_tools)
            if turn.tool_calls and turn.finish_reason == "stop":
                turn.finish_reason = "tool_calls"
            self.history.extend(check_messages([turn.message]))
        else:
            self.text = self.text + text if self.text else ""
        return turn

    # ---- the end of the episode --------------------------------------------------------
    def finish(self) -> None:
        """Set the trajectory's status from the last call and write the session's record."""
        s = self.sample
        self.ended = True
        if self.error is not None:
            s.status, s.finish_reason = Status.FAILED, f"engine_error: {self.error}"[:500]
        elif self.aborted:
            s.status, s.finish_reason = Status.FAILED, "agent_aborted: the episode was aborted mid-call"
        elif not s.response_tokens:
            s.status, s.finish_reason = Status.FAILED, "agent_empty: the agent made no model call"
        else:
            # TRUNCATED when the episode's budget (context, --rollout-max-response-len) ended it;
            # an answer cut at the agent's own max_tokens is the agent's choice
            s.status = Status.TRUNCATED if self.cut else Status.COMPLETED
            s.finish_reason = self.last_finish
        s.response = self.tokenizer.decode(s.response_tokens)
        s.metadata[KEY] = {"calls": self.calls, "segments": self.done_segments, "drift": self.drift}


def _clear(s: Trajectory) -> None:
    s.response_tokens, s.logprobs, s.versions, s.loss_mask, s.segments = [], [], [], [], []
    s.routed_experts = None


def _segment_record(s: Trajectory) -> dict[str, Any]:
    return {"prompt_tokens": s.prompt_tokens, "response_tokens": s.response_tokens, "logprobs": s.logprobs,
            "versions": s.versions, "loss_mask": s.loss_mask,
            "segments": [[g.start, g.end, g.kind] for g in s.segments]}


class SessionStore:
    """Live sessions by id. Ids are 32 random bytes (``secrets.token_urlsafe``): the id in
    the base URL is the only way in, so one session cannot name another; ended ids are
    remembered (bounded) to answer 410 rather than 404."""

    def __init__(self, *, remember_ended: int = 4096) -> None:
        self.live: dict[str, Session] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.remember_ended = remember_ended

    def open(self, sample: Trajectory, ctx: GenerateContext) -> Session:
        sid = secrets.token_urlsafe(32)
        session = self.live[sid] = Session(sid, sample, ctx)
        return session

    def get(self, sid: str) -> Session:
        session = self.live.get(sid)
        if session is not None:
            return session
        if sid in self.ended:
            raise AgentError(410, "this episode has ended: its session takes no more requests", kind="session_ended")
        raise AgentError(404, "no such session", kind="not_found")

    def close(self, session: Session) -> None:
        if self.live.pop(session.id, None) is not None:
            self.ended[session.id] = None
            while len(self.ended) > self.remember_ended:
                self.ended.popitem(last=False)
