"""AgentRollout: the generate function that runs the user's agent once per sample.

Wiring: with ``--custom-agent-function-path`` set, ``miles.actors.factory`` builds one
``AgentRollout`` per rollout worker as its generate function. On its first call it starts
the worker's ``AgentServer`` on the worker's event loop; then for every leased sample it
opens a session, builds an ``openai.AsyncOpenAI`` client pointed at the session's base URL,
and awaits ``fn(client, sample)`` under ``--agent-timeout-s``. Many episodes run at once on
one loop (the worker's ``--max-inflight-per-worker``); their model calls meet in the
engine's continuous batch.

The function's return is the reward: a number, a dict of numbers, or None to leave it to
``--custom-rm-path`` (the worker scores the trajectory as any other). Whatever goes wrong
ends the sample FAILED with a counted reason (``agent/failed/<kind>``) and the worker goes
on: ``agent_error`` (the function raised), ``agent_timeout``, ``agent_invalid`` (it returned
something else), ``agent_empty`` (no model call), ``agent_aborted`` (the worker aborted its
work mid-call: an agent's state lives in its coroutine, so an episode cannot be parked and
resumed like an ``Env`` one), ``engine_error``. ``stats()`` also has the worker's occupancy,
as the ``Env`` path reports it (``agent/busy_s``, ``agent/episode_s``, ``agent/window_s``;
``miles.rollout.occupancy``).
"""

from __future__ import annotations

import asyncio
import math
import numbers
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from miles.agent.config import AgentConfig
from miles.agent.server import AgentServer
from miles.agent.session import Session
from miles.rollout import GenerateContext
from miles.rollout.occupancy import Occupancy
from miles.types import Status, Trajectory
from miles.utils.loading import load_function


class ClientFactory:
    """Builds each episode's ``openai.AsyncOpenAI`` (``miles.agent.client``); imports openai
    on first use, so a run without agents does not need it."""

    def __init__(self) -> None:
        self._factory: Any = None

    def __call__(self, base_url: str, timeout_s: float) -> Any:
        if self._factory is None:
            try:
                from miles.agent.client import ClientFactory as _Factory
            except ImportError as exc:
                raise ImportError("--custom-agent-function-path needs the openai package: "
                                  "pip install 'miles[agent]'") from exc
            self._factory = _Factory()
        return self._factory(base_url, timeout_s)

    async def close(self) -> None:
        if self._factory is not None:
            await self._factory.close()


class AgentRollout:
    """``await rollout(sample, ctx)`` runs one agent episode; ``stats()`` for metrics."""

    def __init__(self, agent_fn: Callable[..., Any], config: AgentConfig | None = None, *,
                 model_name: str = "miles", client_factory: Callable[[str, float], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.agent_fn = agent_fn
        self.config = config or AgentConfig()
        self.server = AgentServer(model_name=model_name)
        self.client_factory = client_factory or ClientFactory()
        self.counters: Counter[str] = Counter()
        self._started: asyncio.Task[None] | None = None
        self.occupancy = Occupancy(clock)

    async def start(self) -> None:
        """Start the session server (once; the first episode does it)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.server.start(self.config.agent_host, self.config.agent_port))
        await asyncio.shield(self._started)

    async def __call__(self, sample: Trajectory, ctx: GenerateContext) -> Trajectory:
        await self.start()
        session = self.server.store.open(sample, ctx)
        self.occupancy.change(+1)
        self.counters["episodes"] += 1
        client = self.client_factory(self.server.base_url(session), self.config.agent_timeout_s)
        failure: tuple[str, str] | None = None
        reward: Any = None
        try:
            async with asyncio.timeout(self.config.agent_timeout_s):
                reward = await self.agent_fn(client, sample)
        except TimeoutError:
            failure = ("agent_timeout", f"the agent ran past --agent-timeout-s {self.config.agent_timeout_s}")
        except Exception as exc:  # the agent's own bug, or an API error it did not handle
            failure = ("agent_error", f"{type(exc).__name__}: {exc}")
        finally:
            self.occupancy.change(-1)
            await self._end(session, ctx)
        self._settle(session, sample, failure, reward)
        return sample

    async def _end(self, session: Session, ctx: GenerateContext) -> None:
        """Close the session; a model call still running (a timed-out agent) is aborted first."""
        self.server.store.close(session)
        if session.lock.locked():
            await ctx.engine.abort(session.sample.id)
            async with session.lock:  # its handler appends what the engine made, then returns
                pass
        session.finish()
        if session.drift:
            self.counters["drift"] += len(session.drift)

    def _settle(self, session: Session, s: Trajectory, failure: tuple[str, str] | None, reward: Any) -> None:
        if session.aborted or session.error is not None:
            failure = None  # the agent's exception (a 5xx it got) follows from these: keep their reason
        if failure is None and s.status is not Status.FAILED:
            if isinstance(reward, bool) or not (reward is None or isinstance(reward, (numbers.Real, dict))):
                failure = ("agent_invalid", f"the agent returned {type(reward).__name__}; expected a number, "
                                            f"a dict of numbers or None")
            elif isinstance(reward, dict):
                if not all(isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
                           and math.isfinite(v) for k, v in reward.items()) or not reward:
                    failure = ("agent_invalid", "the agent's reward dict must map names to finite numbers")
                else:
                    s.reward = {k: float(v) for k, v in reward.items()}
            elif reward is not None:
                if not math.isfinite(float(reward)):
                    failure = ("agent_invalid", f"the agent returned reward {reward!r}")
                else:
                    s.reward = float(reward)
        if failure is not None:
            s.status, s.finish_reason, s.reward = Status.FAILED, f"{failure[0]}: {failure[1]}"[:500], None
        if s.status is Status.FAILED:
            kind = (s.finish_reason or "failed").split(":", 1)[0]
            self.counters[f"failed/{kind}"] += 1
        else:
            self.counters[f"episodes_{s.status.value}"] += 1
        self.counters["calls"] += session.calls

    async def stop(self) -> None:
        """Close the session server and the clients' connection pool."""
        await self.server.stop()
        close = getattr(self.client_factory, "close", None)
        if close is not None:
            await close()

    def stats(self) -> dict[str, float]:
        out = {f"agent/{k}": float(v) for k, v in self.counters.items()}
        out.update({f"agent/server_{k}": float(v) for k, v in self.server.counters.items()})
        out["agent/inflight"] = float(self.occupancy.active)
        out.update(self.occupancy.stats("agent"))
        return out


def build_agent_rollout(cfg: Any) -> AgentRollout:
    """The generate function for a run with ``--custom-agent-function-path`` (the actor factory)."""
    agent_cfg: AgentConfig = cfg.agent
    fn = load_function(agent_cfg.custom_agent_function_path)
    if not asyncio.iscoroutinefunction(fn):
        raise TypeError(f"{agent_cfg.custom_agent_function_path}: the agent must be an async def fn(client, sample)")
    name = cfg.rollout.hf_checkpoint or "miles"
    return AgentRollout(fn, agent_cfg, model_name=str(name).rstrip("/").rsplit("/", 1)[-1])
