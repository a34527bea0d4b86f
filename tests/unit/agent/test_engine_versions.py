"""An agent episode on the real embedded engine across weight updates, checked token by token.

The agent (the real ``openai`` client) runs six calls, each answered by a tool result; the
trainer side publishes a new version while the agent "runs its tool" (between calls), and
once in the middle of the last call, as ``--partial-rollout`` lets it. Every model token must
carry the version whose weights produced it: its behaviour log-prob equals that version's
log-prob given the exact context, and the trained ids are the ids the client was sent.
"""

from __future__ import annotations

import asyncio
import copy

import torch

from miles.agent import AgentRollout
from miles.engines import EmbeddedEngine, EngineConfig
from miles.models import token_logprobs
from miles.types import Status
from tests.unit.engines.helpers import paced
from tests.unit.envs.helpers import TOKENIZER, make_ctx, make_traj
from tests.unit.envs.test_engine_versions import make_model

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
CALLS = 6


def test_agent_episode_spans_versions_token_exactly() -> None:
    models = [make_model(seed) for seed in range(CALLS + 1)]
    engine = paced(EmbeddedEngine(copy.deepcopy(models[0]),
                                  config=EngineConfig(max_seq_len=1024, keep_kv_cache_on_update=False),
                                  tokenizer=TOKENIZER))
    sent: list[list[int]] = []

    async def publish(version: int) -> None:
        await engine.update_weights(list(models[version].state_dict().items()), version)

    async def agent(client, sample):
        messages = [{"role": "system", "content": "tools: lookup"}, {"role": "user", "content": "find it"}]
        for i in range(CALLS):
            # the last call is long: the mid-call update has a wide window to land in
            r = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                     max_tokens=12 if i + 1 < CALLS else 40)
            sent.append(r.choices[0].model_extra["token_ids"])
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            if i + 1 < CALLS:
                await publish(i + 1)  # the tool runs while the trainer publishes
                messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"})
        return 1.0

    async def go():
        ro = AgentRollout(agent)
        t = make_traj("ep")
        task = asyncio.create_task(ro(t, make_ctx(engine, ignore_eos=True)))
        # a weight update in the middle of the last call
        while not (engine.version == CALLS - 1 and (engine.progress("ep") or 0) >= 3) and not task.done():
            await asyncio.sleep(0.0005)
        await engine.pause()
        await publish(CALLS)
        await engine.resume()
        out = await task
        await ro.stop()
        await engine.close()
        return out

    t = asyncio.run(go())
    assert t.status is Status.COMPLETED and t.finish_reason == "length"  # cut by its own max_tokens and t.reward == 1.0
    t.validate(current_version=CALLS)
    model = [g for g in t.segments if g.kind == "model"]
    env = [g for g in t.segments if g.kind == "env"]
    assert len(model) == CALLS and len(env) == CALLS - 1
    # trained ids are exactly the sampled ids the client received
    assert [t.response_tokens[g.start:g.end] for g in model] == sent
    for i, g in enumerate(model):
        assert t.versions[g.start] == i and set(t.loss_mask[g.start:g.end]) == {1}
    for i, g in enumerate(env, start=1):  # tool results and glue: masked, at the version then
        assert set(t.versions[g.start:g.end]) == {i}
        assert set(t.loss_mask[g.start:g.end]) == {0} and set(t.logprobs[g.start:g.end]) == {0.0}
    last = t.versions[model[-1].start:model[-1].end]
    assert last[0] == CALLS - 1 and last[-1] == CALLS and last == sorted(last)  # switched mid-call
    assert len(set(t.loss_versions())) == CALLS + 1

    ids = torch.tensor([t.prompt_tokens + t.response_tokens])
    P = len(t.prompt_tokens)
    with torch.no_grad():
        per_version = [token_logprobs(m(ids).logits[0, P - 1: -1], torch.tensor(t.response_tokens)) for m in models]
    for i, (v, m, lp) in enumerate(zip(t.versions, t.loss_mask, t.logprobs)):
        if m:
            assert abs(per_version[v][i].item() - lp) < 1e-4, (i, v)
