"""Agent sessions through the real ``openai`` client on loopback, on a scripted engine.

Token-exact multi-turn episodes with tool calls, drift, streaming, /v1/completions; bad
agents (raise, hang, call after the end, malformed requests, unknown session, n > 1);
security (loopback by default, unguessable ids, one session cannot reach another).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from miles.agent import AgentConfig, AgentRollout
from miles.agent.chat import render
from miles.types import Status
from tests.unit.envs.helpers import EOS, TOKENIZER, ScriptedEngine, make_ctx, make_traj

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {}}}}]


def call_tokens(a: int, b: int) -> list[int]:
    return TOKENIZER.encode(f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>') + [EOS]


def run_agent(agent: Any, script: list[list[int]], *, version_per_call: bool = True, **config: Any):
    """Run ``agent`` on one sample; the engine's version goes up by one after each call."""
    engine = ScriptedEngine([list(s) for s in script], version=0)
    if version_per_call:
        inner = engine.generate

        async def generate(request):
            out = await inner(request)
            engine.version += 1
            return out

        engine.generate = generate  # type: ignore[method-assign]
    ro = AgentRollout(agent, AgentConfig(**config))

    async def go():
        try:
            return await ro(make_traj(), make_ctx(engine))
        finally:
            await ro.stop()

    return asyncio.run(go()), engine, ro


async def tool_loop(client: openai.AsyncOpenAI, turns: int, *, stream: bool = False) -> tuple[list, list]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "use tools"}, {"role": "user", "content": "go"}]
    responses = []
    for _ in range(turns):
        if stream:
            chunks = [c async for c in await client.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, stream=True)]
            responses.append(chunks)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            msg: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in calls]
        else:
            r = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, logprobs=True)
            responses.append(r)
            msg = r.choices[0].message.model_dump(exclude_none=True)
            calls = r.choices[0].message.tool_calls or []
        messages.append(msg)
        if not calls:
            break
        for c in calls:
            args = json.loads(c.function.arguments)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})
    return messages, responses


@pytest.mark.parametrize("stream", [False, True])
def test_five_turn_tool_episode_is_token_exact(stream) -> None:
    script = [call_tokens(i, i + 1) for i in range(5)] + [TOKENIZER.encode("done") + [EOS]]
    seen: dict[str, Any] = {}

    async def agent(client, sample):
        seen["messages"], seen["responses"] = await tool_loop(client, 6, stream=stream)
        return 1.0

    out, engine, ro = run_agent(agent, script)
    assert out.status is Status.COMPLETED and out.reward == 1.0 and out.finish_reason == "stop"
    out.validate()
    # the trained model tokens are exactly the sampled ones, each with the version it was sampled at
    model_spans = [(g.start, g.end) for g in out.segments if g.kind == "model"]
    assert [out.response_tokens[a:b] for a, b in model_spans] == script
    for i, (a, b) in enumerate(model_spans):
        assert out.versions[a:b] == [i] * (b - a) and out.loss_mask[a:b] == [1] * (b - a)
        assert out.logprobs[a:b] == [-0.5] * (b - a)
    kinds = [g.kind for g in out.segments]
    assert kinds == ["model", "env"] * 5 + ["model"]
    for g in out.segments:
        if g.kind == "env":  # tool results and template glue: masked, written at the version then
            assert out.loss_mask[g.start:g.end] == [0] * (g.end - g.start)
            assert set(out.versions[g.start:g.end]) == {out.versions[g.start - 1] + 1}
    # every call continued the stored ids: nothing was re-tokenized
    for req in engine.requests:
        assert req.input_ids == out.prompt_tokens + out.response_tokens[: req.num_prefix_tokens]
    # the context is what the chat template renders for the final conversation
    msgs = seen["messages"]
    from miles.agent.chat import check_messages
    text = render(TOKENIZER, check_messages(msgs[:-1]), TOOLS, generation_prompt=True)
    glued = TOKENIZER.decode(out.prompt_tokens + out.response_tokens, skip_special_tokens=False)
    assert glued.replace("<eos>", "").startswith(text.replace("<eos>", "")[:40])
    # responses carry the sampled ids and versions
    if not stream:
        for i, r in enumerate(seen["responses"]):
            extra = r.choices[0].model_extra
            assert extra["token_ids"] == script[i] and extra["versions"] == [i] * len(script[i])
            assert r.usage.completion_tokens == len(script[i])
            assert len(r.choices[0].logprobs.content) == len(script[i])
        assert [r.choices[0].finish_reason for r in seen["responses"]] == ["tool_calls"] * 5 + ["stop"]
    else:
        finals = [[c for c in chunks if c.choices and c.choices[0].finish_reason][0] for chunks in seen["responses"]]
        assert [f.choices[0].finish_reason for f in finals] == ["tool_calls"] * 5 + ["stop"]
        assert [f.choices[0].model_extra["token_ids"] for f in finals] == script
    assert out.metadata["agent"]["drift"] == [] and ro.stats()["agent/calls"] == 6.0


def test_plain_turns_extend_with_one_render_each(monkeypatch) -> None:
    """Plain answers: each request's new messages are found in one rendering (the last
    request's rendering + the answer + the close), and the stored text is the template's."""
    import miles.agent.session as session_mod

    script = [TOKENIZER.encode(w) + [EOS] for w in ("alpha", "beta", "gamma", "delta")]
    renders: list[int] = []
    real = session_mod.render

    def counting(*args, **kwargs):
        renders.append(len(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(session_mod, "render", counting)
    seen: dict[str, Any] = {}

    async def agent(client, sample):
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "go"}]
        for _ in script:
            r = await client.chat.completions.create(model="m", messages=messages)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "more"}]
        seen["messages"] = messages[:-1]
        return 1.0

    out, engine, _ = run_agent(agent, script)
    out.validate()
    assert out.metadata["agent"]["drift"] == []
    assert renders == [2, 4, 6, 8]  # one rendering a request: the history is not rendered again
    for req in engine.requests:  # nothing re-tokenized
        assert req.input_ids == out.prompt_tokens + out.response_tokens[: req.num_prefix_tokens]
    model = [out.response_tokens[g.start:g.end] for g in out.segments if g.kind == "model"]
    assert model == script
    # the stored text is the template's rendering of the conversation (the model's EOS aside)
    from miles.agent.chat import check_messages
    last = render(TOKENIZER, check_messages(seen["messages"][:-1]), None, generation_prompt=True)
    glued = TOKENIZER.decode(out.prompt_tokens + out.response_tokens[: engine.requests[-1].num_prefix_tokens],
                             skip_special_tokens=False)
    assert glued.replace("<eos>", "") == last


def test_drifting_history_starts_a_new_segment() -> None:
    script = [call_tokens(1, 2), TOKENIZER.encode("x") + [EOS], TOKENIZER.encode("y") + [EOS]]

    async def agent(client, sample):
        msgs = [{"role": "user", "content": "first"}]
        r = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "3"}]
        await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        edited = [{"role": "user", "content": "first, edited"}, {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="m", messages=edited, tools=TOOLS)
        return 0.5

    out, engine, _ = run_agent(agent, script)
    out.validate()
    meta = out.metadata["agent"]
    assert len(meta["drift"]) == 1 and meta["drift"][0]["call"] == 2 and "do not extend" in meta["drift"][0]["reason"]
    old = meta["segments"][0]
    assert [k for _, _, k in old["segments"]] == ["model", "env", "model"]
    # the trained trajectory is the new segment: its own rendering, then the model's tokens only
    expected_prompt = render(TOKENIZER, [{"role": "user", "content": "first, edited"},
                                         {"role": "user", "content": "again"}], TOOLS, generation_prompt=True)
    assert out.prompt_tokens == TOKENIZER.encode(expected_prompt)
    assert out.response_tokens == script[2] and out.loss_mask == [1] * len(script[2])
    assert out.versions == [2] * len(script[2])
    assert engine.requests[2].input_ids == out.prompt_tokens
    # the old segment kept its exact ids and masks
    assert old["response_tokens"][: len(script[0])] == script[0]
    assert old["loss_mask"] == [1] * len(script[0]) + [0] * (len(old["loss_mask"]) - len(script[0]) - 2) + [1, 1]


def test_completions_extend_by_token_ids_and_text() -> None:
    script = [[70, 71], [72, EOS], [73, EOS]]

    async def agent(client, sample):
        r = await client.completions.create(model="m", prompt="abc", max_tokens=2)
        ids = TOKENIZER.encode("abc") + r.choices[0].model_extra["token_ids"] + [80, 81]
        r2 = await client.completions.create(model="m", prompt=ids, max_tokens=4, logprobs=1)
        assert r2.choices[0].logprobs.token_logprobs == [-0.5, -0.5]
        models = await client.models.list()
        assert [m.id for m in models.data] == ["miles"]
        return None  # left to --custom-rm-path

    out, engine, _ = run_agent(agent, script)
    assert out.status is Status.TRUNCATED or out.status is Status.COMPLETED
    assert out.response_tokens == [70, 71, 80, 81, 72, EOS] and out.loss_mask == [1, 1, 0, 0, 1, 1]
    assert out.reward is None and out.metadata["agent"]["drift"] == []


# ---- bad agents ---------------------------------------------------------------------------


def _failed(agent: Any, **config: Any) -> tuple[str, AgentRollout]:
    out, _, ro = run_agent(agent, [[40, EOS]] * 4, **config)
    assert out.status is Status.FAILED and out.reward is None
    return out.finish_reason, ro


def test_agent_that_raises_fails_its_sample() -> None:
    async def agent(client, sample):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        raise RuntimeError("tool crashed")

    reason, ro = _failed(agent)
    assert reason.startswith("agent_error: RuntimeError: tool crashed")
    assert ro.stats()["agent/failed/agent_error"] == 1.0


def test_agent_that_hangs_times_out() -> None:
    async def agent(client, sample):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        await asyncio.Event().wait()

    reason, ro = _failed(agent, agent_timeout_s=0.2)
    assert reason.startswith("agent_timeout") and ro.stats()["agent/failed/agent_timeout"] == 1.0


def test_occupancy_integrates_episodes_in_flight() -> None:
    """The agent path records the Env path's busy / slot integrals (benchmarks/agentic.py)."""
    ticks = iter(range(10_000))
    engine = ScriptedEngine([[5, EOS]] * 8, version=0)
    ro = AgentRollout(_one_call, clock=lambda: float(next(ticks)))

    async def go():
        try:
            assert "agent/busy_s" not in ro.stats()  # no episode yet: no window
            await ro(make_traj("solo"), make_ctx(engine))
            alone = ro.stats()
            await asyncio.gather(*(ro(make_traj(f"t{i}"), make_ctx(engine)) for i in range(4)))
            return alone, ro.stats()
        finally:
            await ro.stop()

    alone, after = asyncio.run(go())
    assert alone["agent/episode_s"] == alone["agent/busy_s"] > 0  # one episode: in flight = busy
    assert after["agent/episode_s"] > after["agent/busy_s"] > alone["agent/busy_s"]  # overlapping ones count each
    assert after["agent/window_s"] >= after["agent/busy_s"] and after["agent/inflight"] == 0.0


async def _one_call(client, sample):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return 1.0


def test_agent_without_calls_or_with_a_bad_return() -> None:
    async def silent(client, sample):
        return 1.0

    assert _failed(silent)[0].startswith("agent_empty")

    async def bad_return(client, sample):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return "great"

    assert _failed(bad_return)[0].startswith("agent_invalid")


def test_bad_requests_get_4xx_with_a_message() -> None:
    errors: dict[str, Any] = {}

    async def agent(client, sample):
        good = [{"role": "user", "content": "hi"}]
        cases = {
            "not_a_list": {"messages": "hi"},
            "bad_role": {"messages": [{"role": "wizard", "content": "x"}]},
            "no_content": {"messages": [{"role": "user"}]},
            "n2": {"messages": good, "n": 2},
            "temperature": {"messages": good, "temperature": -1},
            "bad_tool_args": {"messages": [*good, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "add", "arguments": "{nope"}}]}]},
        }
        for name, kwargs in cases.items():
            try:
                await client.chat.completions.create(model="m", **kwargs)
            except openai.APIStatusError as exc:
                errors[name] = (exc.status_code, exc.message)
        r = await client.chat.completions.create(model="m", messages=good)
        errors["ok"] = r.choices[0].finish_reason
        bad = openai.AsyncOpenAI(base_url=str(client.base_url).replace(client.base_url.path.split("/")[2], "x" * 43),
                                 api_key="k", max_retries=0)
        try:
            await bad.chat.completions.create(model="m", messages=good)
        except openai.NotFoundError as exc:
            errors["unknown"] = (exc.status_code, exc.message)
        errors["client"] = client
        return 1.0

    out, _, _ = run_agent(agent, [[40, EOS]] * 2)
    assert out.status is Status.COMPLETED  # refused requests do not end the episode
    for name in ("not_a_list", "bad_role", "no_content", "n2", "temperature", "bad_tool_args"):
        status, message = errors[name]
        assert status == 400 and message, name
    assert "n=1" in errors["n2"][1] and "role" in errors["bad_role"][1]
    assert errors["unknown"][0] == 404 and errors["ok"] == "stop"


def test_request_after_the_episode_ended_is_refused() -> None:
    kept: dict[str, Any] = {}

    async def agent(client, sample):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        kept["client"] = client
        return 1.0

    engine = ScriptedEngine([[40, EOS]] * 3)
    ro = AgentRollout(agent)

    async def go():
        out = await ro(make_traj(), make_ctx(engine))
        late = openai.AsyncOpenAI(base_url=str(kept["client"].base_url), api_key="k", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            await late.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
        await ro.stop()
        return out, info.value

    out, exc = asyncio.run(go())
    assert out.status is Status.COMPLETED and out.response_tokens == [40, EOS]  # untouched by the late call
    assert exc.status_code == 410 and "ended" in exc.message
    assert len(engine.requests) == 1


# ---- security -----------------------------------------------------------------------------


def test_sessions_are_on_loopback_unguessable_and_isolated() -> None:
    seen: dict[str, Any] = {}
    engine = ScriptedEngine(default=[40, EOS])
    ro = AgentRollout(lambda c, s: None)

    async def agent(client, sample):
        seen.setdefault("urls", []).append(str(client.base_url))
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": sample.id}])
        await asyncio.sleep(0)
        return 1.0

    ro.agent_fn = agent

    async def go():
        outs = await asyncio.gather(*(ro(make_traj(f"t{i}"), make_ctx(engine)) for i in range(8)))
        sock = ro.server.addresses[0]
        await ro.stop()
        return outs, sock

    outs, sock = asyncio.run(go())
    assert sock[0] == "127.0.0.1"  # loopback unless --agent-host says otherwise
    ids = [u.rstrip("/").split("/")[-2] for u in seen["urls"]]
    assert len(set(ids)) == 8 and all(len(i) >= 40 for i in ids)  # 32 random bytes each
    for i, out in enumerate(outs):  # each session holds its own conversation only
        assert f"t{i}" in TOKENIZER.decode(out.prompt_tokens) and out.status is Status.COMPLETED
        assert all(f"t{j}\n" not in TOKENIZER.decode(out.prompt_tokens) for j in range(8) if j != i)


def test_an_aborted_call_fails_the_episode_as_aborted() -> None:
    engine = ScriptedEngine([[40, 41, EOS]], hold=True)
    seen: dict[str, Any] = {}

    async def agent(client, sample):
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        except openai.APIStatusError as exc:
            seen["status"] = exc.status_code
            raise

    ro = AgentRollout(agent)

    async def go():
        task = asyncio.create_task(ro(make_traj(), make_ctx(engine)))
        await engine.until_waiting(1)
        await engine.abort(None)  # the worker parks its work (sync round end, shutdown)
        out = await task
        await ro.stop()
        return out

    out = asyncio.run(go())
    assert seen["status"] == 503 and out.status is Status.FAILED
    assert out.finish_reason.startswith("agent_aborted") and ro.stats()["agent/failed/agent_aborted"] == 1.0
    assert out.response_tokens == [40] and out.loss_mask == [1]  # what the engine made is recorded
