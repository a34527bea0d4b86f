"""miles.envs: multi-turn environments and tools for agentic rollouts.

An environment is any object with ``reset(sample) -> str`` and ``step(action_text) ->
(observation, reward, done, info)`` (``miles.protocols.Env``; sync or async methods), built
once per episode from ``--env-path pkg.mod:Env`` with ``--env-kwargs``. With ``--env-path``
set, every rollout worker rolls its trajectories out with ``miles.rollout.EnvRollout``.

- ``config.py``    EnvConfig: the ``--env-*`` / ``--max-turns`` ... flags
- ``templates.py`` how an observation is joined to the conversation (chat template / raw)
- ``episode.py``   the episode record kept in the trajectory (resume, replay)
- ``calls.py``     calling Env methods: thread pool, timeouts, checking their returns
- ``tools.py``     tool-call parsing (Hermes/Qwen ``<tool_call>`` JSON, tags) and ToolEnv
"""

from __future__ import annotations

from miles.envs.calls import EnvCaller, EnvFailure, StepResult, check_reset, check_step, load_env_factory
from miles.envs.config import EnvConfig
from miles.envs.episode import EpisodeState, TurnRecord
from miles.envs.templates import TemplateError, TurnTemplate, chat_separators
from miles.envs.tools import ToolCall, ToolCallError, ToolEnv, format_tool_result, parse_tagged, parse_tool_calls


__all__ = [
    "EnvCaller",
    "EnvConfig",
    "EnvFailure",
    "EpisodeState",
    "StepResult",
    "TemplateError",
    "ToolCall",
    "ToolCallError",
    "ToolEnv",
    "TurnRecord",
    "TurnTemplate",
    "chat_separators",
    "check_reset",
    "check_step",
    "format_tool_result",
    "load_env_factory",
    "parse_tagged",
    "parse_tool_calls",
]
