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

from miles.agent import AgentRollout
from miles.engines import EmbeddedEngine, EngineConfig
from miles.types import Status
from tests.unit.engines.helpers import paced
from tests.unit.envs.helpers import TOKENIZER, check_token_versions, make_ctx, make_model, make_traj

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
    check_token_versions(t, models, turns=CALLS)
    model = [g for g in t.segments if g.kind == "model"]
    # trained ids are exactly the sampled ids the client received, all of them trained
    assert [t.response_tokens[g.start:g.end] for g in model] == sent
    assert all(set(t.loss_mask[g.start:g.end]) == {1} for g in model)
