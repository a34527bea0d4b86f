"""AgentConfig: the flags of agent rollouts (section ``agent``).

Setting ``--custom-agent-function-path`` makes every rollout worker run the user's agent
(``async def fn(client: openai.AsyncOpenAI, sample)``) once per sample against a session of
its own OpenAI-compatible server (``miles.agent.server``), instead of the single-turn
generate function (``miles.actors.factory``).
"""

from __future__ import annotations

import msgspec


class AgentConfig(msgspec.Struct, kw_only=True):
    """Bring-your-own agents: which function, where its sessions listen, how long it may run."""

    # "pkg.mod:fn" or "path/file.py:fn": async def fn(client, sample) -> float | dict | None
    custom_agent_function_path: str | None = None
    agent_host: str = "127.0.0.1"  # address the sessions listen on (loopback: other machines cannot reach them)
    agent_port: int = 0  # port of each worker's session server (0: a free one)
    agent_timeout_s: float = 600.0  # an episode running longer fails its sample (agent_timeout)

    def __post_init__(self) -> None:
        if not self.agent_timeout_s > 0:
            raise ValueError(f"agent_timeout_s must be > 0, got {self.agent_timeout_s}")
        if not 0 <= self.agent_port < 65536:
            raise ValueError(f"agent_port must be in [0, 65535], got {self.agent_port}")
        if not self.agent_host:
            raise ValueError("agent_host must not be empty")
