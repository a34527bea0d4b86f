"""EnvRollout: the multi-turn generate function that runs an Env episode on an engine.

Wiring: with ``--env-path`` set, ``miles.actors.factory`` builds one ``EnvRollout`` per
rollout worker and hands it to the worker as its generate function; the worker calls
``await rollout(sample, ctx)`` for every leased trajectory, many at once on one event loop,
and merges ``rollout.stats()`` into its own.

One episode is: ``reset`` (its observation, if any, becomes the prompt), then turns of
model action → ``step`` → observation, until the Env says done or a budget ends it:

- a model turn is one engine request continuing the trajectory's exact tokens; it ends
  at EOS, a stop token/string (``--rollout-stop*``, ``--env-stop*``, the Env's ``stop`` /
  ``stop_token_ids`` attributes) or its token budget. Its tokens carry loss, their
  behaviour log-probs and per-token versions — so a weight update in the middle of a
  turn is recorded token by token, and the next turn's request simply runs on whatever
  weights the engine has then;
- the observation is wrapped by the turn template (``miles.envs.templates``), tokenized
  once, and appended as an env segment (loss mask 0, log-prob 0, the engine's version);
  the next request's input is these very tokens — nothing is ever re-tokenized;
- budgets: ``--max-turns`` and the token caps end an episode TRUNCATED (rewarded);
  ``--episode-timeout-s``, an Env that raises, hangs past ``--turn-timeout-s`` or returns
  garbage ends it FAILED with the reason in ``finish_reason``, counted in
  ``env/failed/<kind>``; the worker goes on with its other episodes;
- when the worker aborts in-flight work (``GenerateContext.aborts`` moves), an episode
  parks as PARTIAL — mid-turn with its tokens kept, or between turns — and keeps its
  live Env here for when it comes back (``miles.envs.episode`` covers a resume elsewhere).

The reward is the sum (or last) of the step rewards, or, with ``--env-reward none``, left
to ``--custom-rm-path``. Synchronous Env methods run in a thread pool, async ones are
awaited, so environment steps overlap with other episodes' decoding.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from miles.envs.calls import EnvCaller, EnvFailure, check_reset, check_step
from miles.envs.config import EnvConfig, resolve_turn_template
from miles.envs.episode import EpisodeState, TurnRecord, json_safe
from miles.envs.templates import TurnTemplate, fingerprint, stop_text
from miles.envs.calls import load_env_factory
from miles.rollout.context import GenerateContext, apply_output
from miles.rollout.occupancy import Occupancy
from miles.types import Status, Trajectory

_NO_LIMIT = 1 << 60


class _Parked:
    __slots__ = ("env", "reset_hash", "since", "turns")

    def __init__(self, env: Any, reset_hash: str | None, turns: int, since: float) -> None:
        self.env, self.reset_hash, self.turns, self.since = env, reset_hash, turns, since


class EnvRollout:
    """``await rollout(sample, ctx)`` runs (or resumes) one episode; ``stats()`` for metrics."""

    def __init__(
        self,
        make_env: Callable[[], Any],
        config: EnvConfig | None = None,
        *,
        tokenizer: Any = None,
        clock: Callable[[], float] = time.monotonic,
        max_parked: int = 1024,
        park_ttl_s: float = 900.0,
    ) -> None:
        self.make_env = make_env
        self.config = config = config or EnvConfig()
        self.caller = EnvCaller(timeout_s=config.turn_timeout_s, threads=config.env_threads)
        self.clock = clock
        self.max_parked, self.park_ttl_s = max_parked, park_ttl_s
        self._templates: dict[int, TurnTemplate] = {}
        if tokenizer is not None:  # fail at build time on a template that cannot work
            self.template(tokenizer)
        self._parked: OrderedDict[str, _Parked] = OrderedDict()
        self._closing: set[asyncio.Task[Any]] = set()
        self.counters: Counter[str] = Counter()
        self.occupancy = Occupancy(clock)

    def template(self, tokenizer: Any) -> TurnTemplate:
        key = id(tokenizer)
        if key not in self._templates:
            cfg = self.config
            mode = resolve_turn_template(cfg.env_turn_template, tokenizer)
            self._templates[key] = TurnTemplate(mode, tokenizer=tokenizer, role=cfg.env_observation_role)
        return self._templates[key]

    async def __call__(self, sample: Trajectory, ctx: GenerateContext) -> Trajectory:
        state = EpisodeState.of(sample)
        episode = _Episode(self, sample, ctx, state)  # raises only for an unusable template
        started = self.clock()
        self.occupancy.change(+1)
        limit = self.config.episode_timeout_s
        try:
            if limit is not None and state.elapsed_s >= limit:
                raise TimeoutError
            async with asyncio.timeout(None if limit is None else limit - state.elapsed_s):
                await episode.run()
        except TimeoutError:
            episode.fail("episode_timeout", f"the episode ran past --episode-timeout-s {limit}")
        except EnvFailure as failure:
            episode.fail(failure.kind, str(failure))
        except Exception as exc:  # e.g. an observation the tokenizer cannot encode
            episode.fail("rollout_error", f"{type(exc).__name__}: {exc}")
        finally:
            state.elapsed_s += self.clock() - started
            state.save(sample)
            self._settle(episode)
            self.occupancy.change(-1)
        return sample

    # ---- live environments -------------------------------------------------------------
    def _settle(self, episode: _Episode) -> None:
        sample, env = episode.sample, episode.env
        status = sample.status
        self.counters[f"episodes_{status.value}"] += 1
        if status is Status.PARTIAL and env is not None:
            self._parked[sample.id] = _Parked(env, episode.state.reset_hash, len(episode.state.turns), self.clock())
            self._expire()
        elif env is not None:
            self.close_later(env)

    def take_parked(self, traj_id: str) -> _Parked | None:
        return self._parked.pop(traj_id, None)

    def _expire(self) -> None:
        now = self.clock()
        while self._parked:
            tid, parked = next(iter(self._parked.items()))
            if len(self._parked) <= self.max_parked and now - parked.since < self.park_ttl_s:
                break
            del self._parked[tid]
            self.counters["parked_expired"] += 1
            self.close_later(parked.env)

    def close_later(self, env: Any) -> None:
        """Call the Env's optional ``close()`` in the background; its failures are counted."""
        close = getattr(env, "close", None)
        if not callable(close):
            return

        async def run() -> None:
            try:
                await self.caller.call("close", close)
            except EnvFailure:
                self.counters["close_failed"] += 1

        task = asyncio.get_running_loop().create_task(run())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def wait_closed(self) -> None:
        """Wait for the background ``close()`` calls started so far."""
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)

    def stats(self) -> dict[str, float]:
        out = {f"env/{k}": float(v) for k, v in self.counters.items()}
        ended = sum(v for k, v in self.counters.items() if k.startswith("episodes_") and k != "episodes_partial")
        out["env/parked_envs"] = float(len(self._parked))
        out["env/thread_pools_replaced"] = float(self.caller.pools_replaced)
        out["env/inflight"] = float(self.occupancy.active)
        out.update(self.occupancy.stats("env"))
        if ended:
            out["env/turns_per_episode"] = self.counters["turns_of_ended"] / ended
        return out

    def shutdown(self) -> None:
        self.caller.shutdown()


class _Episode:
    """One call's worth of an episode: run turns until it ends or parks."""

    def __init__(self, owner: EnvRollout, sample: Trajectory, ctx: GenerateContext, state: EpisodeState) -> None:
        self.owner, self.sample, self.ctx, self.state = owner, sample, ctx, state
        self.cfg = owner.config
        self.tokenizer = ctx.tokenizer
        self.template = owner.template(ctx.tokenizer)
        self.epoch = getattr(ctx, "aborts", 0)
        self.env: Any = None
        self.after: str | None = None  # the stop text that ended the last model turn
        self.stop: list[str] = []
        self.stop_ids: list[int] = []
        engine_ctx = getattr(getattr(ctx.engine, "config", None), "max_seq_len", None)
        caps = [c for c in (self.cfg.max_total_tokens, engine_ctx) if c]
        self.context_limit = min(caps) if caps else _NO_LIMIT

    async def run(self) -> None:
        await self._attach_env()
        self._read_stops()
        while await self._model_turn():
            await self._env_turn()
            if self.sample.status.finished:
                return

    # ---- environment lifecycle ---------------------------------------------------------
    async def _attach_env(self) -> None:
        s, st = self.sample, self.state
        parked = self.owner.take_parked(s.id)
        if parked is not None:
            if st.reset_hash is not None and parked.reset_hash == st.reset_hash and parked.turns == len(st.turns):
                self.env = parked.env
                return
            self.owner.close_later(parked.env)  # the trajectory was cut back: the Env is ahead
        call = self.owner.caller.call
        self.env = await call("the Env constructor", self.owner.make_env)
        first = check_reset(await call("reset", self.env.reset, s), allow_messages=self.template.mode == "chat")
        if st.reset_hash is None:
            if s.response_tokens:
                raise EnvFailure("env_state_lost", "the trajectory has a response but no episode record")
            st.reset_hash = fingerprint(first)
            if first:
                self._set_prompt(first)
            return
        await self._replay(first)

    async def _replay(self, first: str | list[dict[str, Any]]) -> None:
        """Bring a fresh Env to where the recorded turns left off (resume on a new worker)."""
        st, call = self.state, self.owner.caller.call
        self.owner.counters["replays"] += 1
        if fingerprint(first) != st.reset_hash:
            raise EnvFailure("env_replay_mismatch", "reset returned a different observation on replay")
        for i, turn in enumerate(st.turns):
            action = self.tokenizer.decode(self.sample.response_tokens[turn.start: turn.end])
            result = check_step(await call("step", self.env.step, action))
            if fingerprint(result.observation) != turn.obs_hash or result.done:
                raise EnvFailure("env_replay_mismatch", f"turn {i} gave a different result on replay")

    def _set_prompt(self, first: str | list[dict[str, Any]]) -> None:
        text = self.template.prompt_text(first)
        data = getattr(getattr(self.ctx, "config", None), "data", None)
        tokens = self.tokenizer.encode_prompt(text, chat=self.template.mode == "chat",
                                              add_special_tokens=getattr(data, "add_special_tokens", None))
        if not tokens or len(tokens) >= self.context_limit:
            raise EnvFailure("env_invalid", f"reset's prompt has {len(tokens)} tokens; the context holds "
                                            f"{self.context_limit} (one response token at least)")
        self.sample.prompt, self.sample.prompt_tokens = text, tokens

    def _read_stops(self) -> None:
        stop = getattr(self.env, "stop", None) or []
        stop_ids = getattr(self.env, "stop_token_ids", None) or []
        if not all(isinstance(x, str) and x for x in stop) or not all(isinstance(x, int) for x in stop_ids):
            raise EnvFailure("env_invalid", "Env.stop must be a list of non-empty str and stop_token_ids a list of int")
        base = self.ctx.sampling
        self.stop = list(dict.fromkeys([*base.stop, *self.cfg.env_stop, *stop]))
        self.stop_ids = list(dict.fromkeys([*base.stop_token_ids, *self.cfg.env_stop_token_ids, *stop_ids]))

    # ---- turns ---------------------------------------------------------------------------
    def _room(self) -> int:
        """Tokens the context may still take (engine context and --max-total-tokens)."""
        s = self.sample
        return self.context_limit - len(s.prompt_tokens) - len(s.response_tokens)

    async def _model_turn(self) -> bool:
        """Generate (or continue) the open model turn; False when the episode stops here."""
        s, st, cfg = self.sample, self.state, self.cfg
        if getattr(self.ctx, "aborts", 0) != self.epoch:  # the worker is parking its work
            s.status, s.finish_reason = Status.PARTIAL, None
            return False
        budget = self._room()
        if cfg.max_turn_tokens is not None:
            budget = min(budget, cfg.max_turn_tokens - (len(s.response_tokens) - st.turn_start))
        request = self.ctx.request_for(s, max_new_tokens=max(budget, 0), stop=self.stop, stop_token_ids=self.stop_ids)
        if request.sampling.max_new_tokens <= request.num_prefix_tokens:
            self._finish(Status.TRUNCATED, "length")
            return False
        out = await self.ctx.engine.generate(request)
        apply_output(s, out)
        if s.status in (Status.PARTIAL, Status.FAILED):
            return False
        self.after = stop_text(self.tokenizer, out.matched_stop) if out.finish_reason == "stop" else None
        return True

    async def _env_turn(self) -> None:
        s, st, owner = self.sample, self.state, self.owner
        start, end = st.turn_start, len(s.response_tokens)
        action = self.tokenizer.decode(s.response_tokens[start:end])
        t0 = owner.clock()
        try:
            result = check_step(await owner.caller.call("step", self.env.step, action))
        finally:
            owner.counters["env_s"] += owner.clock() - t0
        owner.counters["turns"] += 1
        if result.info:
            st.info = json_safe(result.info)
        turn = TurnRecord(start, end, end, fingerprint(result.observation), result.reward)
        if result.done:
            st.turns.append(turn)
            reason = "env_truncated" if result.truncated else "env_done"
            self._finish(Status.TRUNCATED if result.truncated else Status.COMPLETED, reason)
            return
        if len(st.turns) + 1 >= self.cfg.max_turns:
            st.turns.append(turn)
            self._finish(Status.TRUNCATED, "max_turns")
            return
        tokens = self.tokenizer.encode(self.template.observation_text(result.observation, after=self.after))
        response_left = self.ctx.max_response_len - end
        if len(tokens) + 1 > min(self._room(), response_left):
            st.turns.append(turn)
            self._finish(Status.TRUNCATED, "length")
            return
        s.append(tokens, [0.0] * len(tokens), self.ctx.engine.version, kind="env")
        turn.obs_end = len(s.response_tokens)
        st.turns.append(turn)
        s.status, s.finish_reason = Status.RUNNING, None

    # ---- endings -----------------------------------------------------------------------
    def _finish(self, status: Status, reason: str) -> None:
        s, cfg = self.sample, self.cfg
        s.status, s.finish_reason = status, reason
        rewards = self.state.rewards()
        if cfg.env_reward == "sum":
            s.reward = float(sum(rewards))
        elif cfg.env_reward == "last":
            s.reward = float(rewards[-1]) if rewards else 0.0
        s.response = self.tokenizer.decode(s.response_tokens)
        self.owner.counters["turns_of_ended"] += len(self.state.turns)

    def fail(self, kind: str, detail: str) -> None:
        s = self.sample
        s.status, s.finish_reason, s.reward = Status.FAILED, f"{kind}: {detail}"[:500], None
        self.owner.counters[f"failed/{kind}"] += 1
        self.owner.counters["turns_of_ended"] += len(self.state.turns)


def build_env_rollout(cfg: Any, tokenizer: Any = None) -> EnvRollout:
    """The generate function for a run with ``--env-path`` (called by the actor factory)."""
    env_cfg: EnvConfig = cfg.env
    if not env_cfg.env_path:
        raise ValueError("build_env_rollout needs --env-path")
    return EnvRollout(load_env_factory(env_cfg.env_path, env_cfg.env_kwargs), env_cfg, tokenizer=tokenizer)
