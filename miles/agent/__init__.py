"""miles.agent: train an agent that already exists, written against the OpenAI API.

``--custom-agent-function-path pkg.mod:fn`` names ``async def fn(client: openai.AsyncOpenAI,
sample) -> float | dict | None``. Each rollout worker serves OpenAI-compatible sessions on
loopback; the runtime calls ``fn`` once per sample with a client pointed at a session of its
own, and trains on that session's exact tokens (model tokens carry loss; system, user, tool
and template tokens are masked) with the reward ``fn`` returns.

- ``config.py``  AgentConfig: the ``--agent-*`` / ``--custom-agent-function-path`` flags
- ``rollout.py`` AgentRollout: the generate function that runs the agent (timeouts, failures)
- ``client.py``  the episode's ``openai.AsyncOpenAI``, lean for loopback (no request transform)
- ``transport.py`` a small keep-alive HTTP/1.1 client under it
- ``server.py``  AgentServer: the session routes (``/s/<id>/v1/chat/completions``, ...)
- ``http.py``    a small HTTP/1.1 server under it (an ``asyncio.Protocol``)
- ``session.py`` Session: an episode's tokens, extended request by request; drift
- ``chat.py``    request checks, chat-template rendering, tool-call parsing
"""

from __future__ import annotations

from miles.agent.chat import AgentError
from miles.agent.config import AgentConfig
from miles.agent.rollout import AgentRollout, build_agent_rollout
from miles.agent.server import AgentServer
from miles.agent.session import Session, SessionStore

__all__ = ["AgentConfig", "AgentError", "AgentRollout", "AgentServer", "Session", "SessionStore",
           "build_agent_rollout"]
