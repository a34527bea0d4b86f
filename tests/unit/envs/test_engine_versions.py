"""On the real embedded engine: an episode across weight updates, checked token by token.

Each model token must carry the version whose weights produced it: its behaviour log-prob
equals the log-prob that version's model assigns it given the exact context. Updates land
between turns (inside an env step) and in the middle of a turn.
"""

from __future__ import annotations

import asyncio
import copy

import torch

from miles.engines import EmbeddedEngine, EngineConfig
from miles.envs import EnvConfig
from miles.rollout import EnvRollout
from miles.models import CausalLM, tiny_config, token_logprobs
from miles.types import Status, Trajectory
from tests.unit.engines.helpers import paced
from tests.unit.envs.helpers import TOKENIZER, make_ctx, make_traj


def make_model(seed: int) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(tiny_config(initializer_range=0.1)).eval()


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
    model_segs = [s for s in t.segments if s.kind == "model"]
    env_segs = [s for s in t.segments if s.kind == "env"]
    assert len(model_segs) == 3 and len(env_segs) == 2
    # between turns: turn i starts on version i; env tokens carry the version at append
    for i, seg in enumerate(model_segs):
        assert t.versions[seg.start] == i
    for i, seg in enumerate(env_segs, start=1):
        assert set(t.versions[seg.start: seg.end]) == {i}
        assert set(t.loss_mask[seg.start: seg.end]) == {0} and set(t.logprobs[seg.start: seg.end]) == {0.0}
    last = t.versions[model_segs[-1].start: model_segs[-1].end]
    assert last[0] == 2 and last[-1] == 3 and last == sorted(last)  # switched mid-turn
    assert len(set(t.loss_versions())) == 4

    # the behaviour log-prob of each model token is its version's model's log-prob
    ids = torch.tensor([t.prompt_tokens + t.response_tokens])
    P = len(t.prompt_tokens)
    with torch.no_grad():
        per_version = [token_logprobs(m(ids).logits[0, P - 1: -1], torch.tensor(t.response_tokens)) for m in models]
    for i, (v, m, lp) in enumerate(zip(t.versions, t.loss_mask, t.logprobs)):
        if m:
            assert abs(per_version[v][i].item() - lp) < 1e-4, (i, v)


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
