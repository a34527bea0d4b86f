"""EnvConfig: the flags of multi-turn environment rollouts (section ``env``).

Field names are the CLI flags (``--env-path``, ``--max-turns`` ...). Setting ``--env-path``
makes every rollout worker roll episodes out with ``miles.rollout.EnvRollout`` instead of the
single-turn generate function (``miles.actors.factory``).

Budgets, from the outside in: ``--episode-timeout-s`` (wall time spent on one episode by
workers, parked time excluded), ``--max-turns``, ``--max-total-tokens`` (prompt plus every
turn: the context an episode may reach; the engine's context caps it too),
``--rollout-max-response-len`` (the response: model and environment tokens together),
``--max-turn-tokens`` (one model turn), ``--turn-timeout-s`` (one call into the
environment: its constructor, ``reset`` or ``step``; decoding time is not counted, it is
bounded by the token budgets).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

TEMPLATE_MODES = ("auto", "chat", "raw")


class EnvConfig(msgspec.Struct, kw_only=True):
    """Multi-turn environments: which one, its budgets, and how turns are joined."""

    # "pkg.mod:Env" or "path/file.py:Env": a class (or factory) called once per episode
    # with ``--env-kwargs`` as keyword arguments.
    env_path: str | None = None
    env_kwargs: dict[str, Any] = {}  # keyword arguments for the environment (JSON or k=v,...)
    max_turns: int = 8  # model turns per episode
    max_total_tokens: int | None = None  # most tokens of a whole episode (prompt, turns, observations)
    max_turn_tokens: int | None = None  # most tokens of one model turn
    turn_timeout_s: float = 60.0  # longest call into the environment
    episode_timeout_s: float | None = None  # longest episode, wall clock
    # Extra stop strings / token ids that end a model turn (besides EOS, the --rollout-stop*
    # ones and what the Env declares in its ``stop`` / ``stop_token_ids`` attributes).
    env_stop: list[str] = []
    env_stop_token_ids: list[int] = []
    # How an observation is joined to the conversation: "chat" (the tokenizer's chat
    # template, as a message of --env-observation-role), "raw" (the text as is), "auto" (chat
    # where the tokenizer has a chat template, else raw; decided once before the run starts),
    # or a format string containing "{observation}" (e.g. "\n<obs>{observation}</obs>\n").
    env_turn_template: str = "auto"
    env_observation_role: str = "user"  # the chat role of an observation message (e.g. tool)
    # The episode's reward: the sum or the last of the step rewards, or "none" to leave it
    # to --custom-rm-path (which then scores the whole transcript).
    env_reward: Literal["sum", "last", "none"] = "sum"
    # Threads that run synchronous Env methods (async ones run on the worker's loop).
    env_threads: int = 16

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        for name in ("max_total_tokens", "max_turn_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")
        if not self.turn_timeout_s > 0:
            raise ValueError(f"turn_timeout_s must be > 0, got {self.turn_timeout_s}")
        if self.episode_timeout_s is not None and not self.episode_timeout_s > 0:
            raise ValueError(f"episode_timeout_s must be > 0 (or unset), got {self.episode_timeout_s}")
        if self.env_threads < 1:
            raise ValueError(f"env_threads must be >= 1, got {self.env_threads}")
        t = self.env_turn_template
        if t not in TEMPLATE_MODES and "{observation}" not in t:
            raise ValueError(
                f"env_turn_template must be 'auto', 'chat', 'raw' or a format string containing "
                f"'{{observation}}', got {t!r}"
            )
        if not self.env_observation_role:
            raise ValueError("env_observation_role must not be empty")


def resolve_turn_template(mode: str, tokenizer: Any) -> str:
    """``auto`` → ``chat`` where the tokenizer has a chat template, else ``raw``; others as given."""
    if mode != "auto":
        return mode
    return "chat" if getattr(tokenizer, "chat_template", None) is not None else "raw"
