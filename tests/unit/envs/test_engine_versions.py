"""On the real embedded engine: an episode across weight updates, checked token by token.

Each model token must carry the version whose weights produced it: its behaviour log-prob
equals the log-prob that version's model assigns it given the exact context. Updates land
between turns (inside an env step) and in the middle of a turn.
"""

from __future__ import annotations

import asyncio
import copy

from miles.engines import EmbeddedEngine, EngineConfig
from miles.envs import EnvConfig
from miles.rollout import EnvRollout
from miles.models import CausalLM
from miles.types import Status, Trajectory
from tests.unit.engines.helpers import paced
from tests.unit.envs.helpers import TOKENIZER, check_token_versions, make_ctx, make_model, make_traj


def run_episode(models: list[CausalLM], *, turns: int = 3, turn_tokens: int = 24, mid_turn_update: bool = True,
                tid: str = "t0") -> Trajectory:
    """Turn i (i ≥ 1) starts on version i (updated inside step i); with ``mid_turn_update``
    the last turn switches to version ``turns`` after a few tokens."""
    # paced (≥ 1 ms a decode step): the mid-turn update must land before the turn's few tokens
    # are done, however fast the CPU decode kernel makes them
    engine = paced(EmbeddedEngine(copy.deepcopy(models[0]),
                                  config=EngineConfig(max_seq_len=512, keep_kv_cache_on_update=False),
                                  tokenizer=TOKENIZER))

    async def publish(version: int) -> None:
        await engine.update_weights(list(models[version].state_dict().items()), version)

    class Updating:
        def __init__(self) -> None:
            self.n = 0

        def reset(self, sample):
            return ""

        async def step(self, action):
            self.n += 1
            if self.n < turns:
                await publish(self.n)
            return f"step {self.n} done", 1.0, self.n >= turns, {}

    async def go() -> Trajectory:
        ro = EnvRollout(Updating, EnvConfig(max_turn_tokens=turn_tokens), tokenizer=TOKENIZER)
        ctx = make_ctx(engine, ignore_eos=True)
        t = make_traj(tid)
        task = asyncio.create_task(ro(t, ctx))
        if mid_turn_update:
            while not (engine.version == turns - 1 and (engine.progress(tid) or 0) >= 3) and not task.done():
                await asyncio.sleep(0.0005)
            await engine.pause()
            await publish(turns)
            await engine.resume()
        out = await task
        await engine.close()
        return out

    return asyncio.run(go())


def test_every_token_records_the_version_that_produced_it() -> None:
    models = [make_model(seed) for seed in range(4)]
    t = run_episode(models)
    assert t.status is Status.COMPLETED
    t.validate(current_version=3)
    check_token_versions(t, models, turns=3)


def test_engine_stats_can_be_read_while_it_decodes() -> None:
    # Workers report engine stats (pings) while episodes decode on the stepping thread; a
    # tiny switch interval makes a thread switch inside stats() likely.
    import sys

    from miles.types import GenerateRequest, SamplingParams

    async def go() -> int:
        engine = EmbeddedEngine(make_model(0), config=EngineConfig(max_seq_len=512, max_batch_size=4))
        sp = SamplingParams(max_new_tokens=400, ignore_eos=True)
        tasks = [asyncio.create_task(engine.generate(GenerateRequest(rid=f"r{i}", input_ids=[5, 6, 7], sampling=sp)))
                 for i in range(4)]
        calls = 0
        while not all(t.done() for t in tasks):
            engine.stats()
            calls += 1
            await asyncio.sleep(0)
        await engine.close()
        return calls

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        assert asyncio.run(go()) > 0
    finally:
        sys.setswitchinterval(old)
