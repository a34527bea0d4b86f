"""RolloutWorker in-process (no Ray): a real engine and buffer; abort parks PARTIAL work that
resumes to the full length budget; drain vs in-place weight updates."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.actors.rollout_worker import RolloutWorker
from miles.buffers import BufferConfig, ReplayBuffer
from miles.engines import EmbeddedEngine, EngineConfig
from miles.models import CausalLM, build_tiny_tokenizer, tiny_config
from miles.rollout import GenerateContext, generate_single_turn
from miles.types import PromptSample, SamplingParams, Status, Trajectory
from miles.transports.weights import pack_all

from .engines.helpers import paced


def _worker(partial: bool, max_len: int = 40) -> tuple[RolloutWorker, ReplayBuffer, CausalLM]:
    torch.manual_seed(0)
    model = CausalLM(tiny_config())
    model.reset_parameters()
    source = CausalLM(tiny_config())
    source.load_state_dict(model.state_dict())
    tok = build_tiny_tokenizer()
    engine = EmbeddedEngine(model, config=EngineConfig(max_batch_size=8, max_seq_len=128), tokenizer=tok)
    paced(engine)  # abort / weight-update tests act mid-generation, whatever the decode speed
    engine.start()
    buf = ReplayBuffer(BufferConfig(max_staleness=8, n_samples_per_prompt=2))
    ctx = GenerateContext(engine=engine, tokenizer=tok, max_response_len=max_len, seed=1,
                          sampling=SamplingParams(ignore_eos=True))
    worker = RolloutWorker("w0", engine=engine, context=ctx, generate_fn=generate_single_turn, buffer=buf,
                           local_reward=None, partial_rollout=partial, max_inflight=4)
    return worker, buf, source


def _prompts(n: int) -> list[PromptSample]:
    tok = build_tiny_tokenizer()
    return [PromptSample(prompt_id=f"p{i}", prompt=f"q{i}", prompt_tokens=tok.encode(f"q{i}")) for i in range(n)]


async def _first_batch_then_stop(worker: RolloutWorker, buf: ReplayBuffer, run: asyncio.Task) -> list[Trajectory]:
    """Wait for the first 2-group batch at version 1, stop the worker, return its trajectories."""
    got: list[list[Trajectory]] = []
    while not got:
        got = buf.get_batch(2, 1)
        await asyncio.sleep(0.02)
    await worker.stop()
    await run
    await worker.engine.close()
    return [t for g in got for t in g]


def test_request_budget_counts_from_the_prompt() -> None:
    ctx = GenerateContext(engine=None, tokenizer=None, sampling=SamplingParams(), max_response_len=10)  # type: ignore[arg-type]
    t = Trajectory(id="t", prompt_id="p", group_id="g", prompt_tokens=[1, 2])
    t.append([3, 4, 5], [0.0] * 3, 0)
    req = ctx.request_for(t)
    assert (req.num_prefix_tokens, req.sampling.max_new_tokens, req.input_ids) == (3, 10, [1, 2, 3, 4, 5])
    assert ctx.request_for(t, max_new_tokens=4).sampling.max_new_tokens == 7
    assert ctx.request_for(t).sampling.seed == ctx.request_for(t).sampling.seed  # resume redraws the same


def test_abort_parks_partial_and_resume_reaches_full_length() -> None:
    async def scenario() -> list[Trajectory]:
        worker, buf, source = _worker(partial=True)
        buf.add_prompts(_prompts(2))
        run = asyncio.create_task(worker.run())
        while worker.engine.stats().get("rollout/tokens_generated", 0) < 8:
            await asyncio.sleep(0.01)
        assert await worker.abort_inflight(hold_until_version=1) > 0
        await asyncio.sleep(0.1)
        assert buf.ledger().partial > 0  # parked, and not re-leased before version 1
        assert buf.ledger().in_flight == 0
        buf.set_version(1)
        await worker.receive_weights(1, pack_all(source.state_dict().items(), version=1, bucket_bytes=1 << 20))
        return await _first_batch_then_stop(worker, buf, run)

    trajs = asyncio.run(scenario())
    assert all(len(t.response_tokens) == 40 and t.status is Status.TRUNCATED for t in trajs)
    assert any(t.num_segments >= 2 for t in trajs)


def test_a_worker_started_behind_waits_for_the_published_weights() -> None:
    """A worker started on a resumed run holds the base weights: it leases nothing until the
    resync of the newest version lands, so no token comes from the stale base model."""
    async def scenario() -> list[Trajectory]:
        worker, buf, source = _worker(partial=True)
        buf.set_version(1)
        buf.add_prompts(_prompts(2))
        run = asyncio.create_task(worker.run(hold_until_version=1))
        await asyncio.sleep(0.2)
        assert buf.ledger().in_flight == 0 and worker.engine.stats().get("rollout/tokens_generated", 0) == 0
        await worker.receive_weights(1, pack_all(source.state_dict().items(), version=1, bucket_bytes=1 << 20))
        return await _first_batch_then_stop(worker, buf, run)

    trajs = asyncio.run(scenario())
    assert {v for t in trajs for v in t.versions} == {1}


@pytest.mark.parametrize("partial", [True, False])
def test_weight_update_in_place_or_drained(partial: bool) -> None:
    async def scenario() -> list[Trajectory]:
        worker, buf, source = _worker(partial=partial, max_len=60)
        buf.add_prompts(_prompts(2))
        run = asyncio.create_task(worker.run())
        while worker.engine.stats().get("rollout/tokens_generated", 0) < 10:
            await asyncio.sleep(0.01)
        with torch.no_grad():
            for p in source.parameters():
                p.add_(0.01)
        buf.set_version(1)
        buckets = pack_all(source.state_dict().items(), version=1, bucket_bytes=1 << 16)
        assert await worker.receive_weights(1, buckets) == 1
        return await _first_batch_then_stop(worker, buf, run)

    trajs = asyncio.run(scenario())
    spans = {tuple(sorted(set(t.versions))) for t in trajs}
    if partial:
        assert (0, 1) in spans  # generations continued on the new weights
    else:
        assert spans == {(0,)}  # drained: every trajectory from one version


def test_a_refused_put_drops_only_that_trajectory() -> None:
    """A lease that expired while the worker held it: the buffer refuses that one put, the
    rest of the batch lands, and the worker keeps running."""

    async def scenario() -> tuple[RolloutWorker, ReplayBuffer]:
        worker, buf, _ = _worker(partial=True, max_len=8)
        buf.add_prompts(_prompts(1))
        a, b = buf.lease("w0", 2)
        buf.release_worker("w0")  # as if the lease expired: both go back to the queue
        (b2,) = buf.lease("w0", 1)  # b is leased again; a is not
        for t in (a, b2):
            t.append([5], [-0.1], 0)
            t.status = Status.COMPLETED
            t.reward = 1.0
        worker._outbox = [a, b2]
        await worker._flush()
        await worker.engine.close()
        return worker, buf

    worker, buf = asyncio.run(scenario())
    assert worker.counters["refused_puts"] == 1 and "not leased" in worker.last_refusal
    led = buf.ledger()
    assert (led.waiting, led.queued) == (1, 1)
    led.check()


def test_routing_is_recorded_from_the_first_token_only() -> None:
    """``record_routing`` starts a fresh trajectory's routing list; a trajectory that already
    has response tokens without routing is left alone (its rows would not line up)."""
    from miles.rollout import GenerateContext
    from miles.types import SamplingParams, Trajectory

    ctx = GenerateContext(engine=None, tokenizer=None, sampling=SamplingParams(), max_response_len=8,
                          record_routing=True)
    fresh = Trajectory(id="a", prompt_id="p", group_id="g", index_in_group=0, prompt_tokens=[1, 2])
    assert ctx.request_for(fresh).return_routed_experts and fresh.routed_experts == []
    started = Trajectory(id="b", prompt_id="p", group_id="g", index_in_group=1, prompt_tokens=[1, 2])
    started.append([5], [-0.1], [0])
    assert not ctx.request_for(started).return_routed_experts and started.routed_experts is None
    off = GenerateContext(engine=None, tokenizer=None, sampling=SamplingParams(), max_response_len=8)
    plain = Trajectory(id="c", prompt_id="p", group_id="g", index_in_group=2, prompt_tokens=[1, 2])
    assert not off.request_for(plain).return_routed_experts


def test_the_worker_reports_starved_time_and_event_loop_lag() -> None:
    """``rollout/starved_s``: the time the worker had room for work and the buffer gave it
    none; ``rollout/loop_lag_s`` / ``loop_lag_max_s``: how late its event loop woke up. With
    the engine's idle time they say whether an unfed engine waited on the buffer or on its
    worker's own loop."""
    import time

    async def scenario() -> tuple[dict[str, float], float, float]:
        worker, buf, _ = _worker(partial=True)
        start = time.monotonic()
        run = asyncio.create_task(worker.run())
        await asyncio.sleep(0.3)  # nothing to lease
        time.sleep(0.15)  # something holds the worker's event loop
        buf.add_prompts(_prompts(2))  # 4 trajectories: its max_inflight, so no room while they run
        while not worker.engine.stats().get("rollout/tokens_generated", 0):  # it has work
            await asyncio.sleep(0.01)
        fed = time.monotonic() - start
        while worker.counters["finished"] < 4:
            await asyncio.sleep(0.01)
        # the starved spells that ended by now: the one before the lease (the idle time after
        # the last trajectory is added when the worker stops)
        before = worker.counters["starved_s"]
        await worker.stop()
        await run
        await worker.engine.close()
        return worker.stats(), before, fed

    stats, before, fed = asyncio.run(scenario())
    # the empty 0.45 s, ended by the lease (before the first token, however long a loaded
    # machine takes to get there), not the generation after it
    assert 0.4 <= before <= fed, (before, fed)
    assert stats["rollout/starved_s"] >= before
    assert stats["rollout/loop_lag_max_s"] >= 0.1
    assert stats["rollout/loop_lag_s"] >= stats["rollout/loop_lag_max_s"]


def test_a_dict_reward_without_the_reward_key_fails_with_its_keys() -> None:
    """--reward-key names an entry the reward dict lacks: the trajectory fails at the worker,
    with the keys the dict has, instead of a KeyError inside the trainer at step 1; the
    metrics of a batch and of an evaluation read the same entry as the trainer."""
    from miles.evaluation import eval_metrics
    from miles.outputs import batch_metrics

    worker, _, _ = _worker(partial=False)
    worker.reward_key = "acc"
    t = Trajectory(id="t", prompt_id="p", group_id="g", prompt_tokens=[1], status=Status.COMPLETED,
                   reward={"score": 1.0, "fmt": 0.5})
    worker._check_reward_key(t)
    assert t.status is Status.FAILED and t.reward is None
    assert t.finish_reason == ("reward_key_missing: the reward dict has no key 'acc' (keys: fmt, score); "
                               "--reward-key names one of them")
    ok = [Trajectory(id=f"t{i}", prompt_id="p", group_id="g", prompt_tokens=[1], status=Status.COMPLETED,
                     reward={"acc": float(i), "fmt": 0.5}) for i in range(2)]
    for t in ok:
        worker._check_reward_key(t)
        assert t.status is Status.COMPLETED
    assert batch_metrics([ok], 0, "acc")["rollout/reward_mean"] == 0.5  # the trainer's entry, not the sum (1.0)
    assert batch_metrics([ok], 0)["rollout/reward_mean"] == 1.0
    assert eval_metrics(ok, 2, "acc")["eval/pass@1"] == 0.5 and eval_metrics(ok, 2)["eval/pass@1"] == 1.0
    asyncio.run(worker.engine.close())


def test_a_summed_dict_reward_is_warned_about_once(caplog) -> None:
    """Without --reward-key a dict reward trains on its sum (documented), which is rarely what a
    reward returning {'score', 'len'} meant: the worker says so once, naming the entries."""
    worker, _, _ = _worker(partial=False)
    with caplog.at_level("WARNING", logger="miles.actors.rollout_worker"):
        for i in range(3):
            t = Trajectory(id=f"t{i}", prompt_id="p", group_id="g", prompt_tokens=[1], status=Status.COMPLETED,
                           reward={"score": 1.0, "len": 7.0})
            worker._check_reward_key(t)
            assert t.status is Status.COMPLETED and t.scalar_reward() == 8.0
        single = Trajectory(id="s", prompt_id="p", group_id="g", prompt_tokens=[1], status=Status.COMPLETED,
                            reward={"acc": 1.0})
        worker._check_reward_key(single)
    warnings = [r.getMessage() for r in caplog.records if "--reward-key is not set" in r.getMessage()]
    assert warnings == ["the reward function returns a dict (len, score) and --reward-key is not set: training "
                        "on the sum of its entries; set --reward-key to train on one of them"]
    asyncio.run(worker.engine.close())


def test_the_uniform_reward_filter_judges_the_reward_key_entry(tmp_path) -> None:
    """With --reward-key the run binds the key to a dynamic-sampling filter that takes it:
    a group whose 'acc' entries are equal is dropped even though the dicts' sums differ."""
    from miles.actors.factory import buffer_args
    from miles.buffers.policies import filter_name
    from miles.config import default_config

    group = [Trajectory(id=f"t{i}", prompt_id="p", group_id="g", prompt_tokens=[1], status=Status.COMPLETED,
                        reward={"acc": 1.0, "fmt": float(i)}) for i in range(2)]
    cfg = default_config(dynamic_sampling_filter_path="miles.buffers:drop_uniform_rewards", reward_key="acc")
    (keyed,) = buffer_args(cfg)["group_filters"]
    assert keyed(group) is False and filter_name(keyed) == "drop_uniform_rewards"
    (summed,) = buffer_args(default_config(dynamic_sampling_filter_path="miles.buffers:drop_uniform_rewards"))["group_filters"]
    assert summed(group) is True


def test_buffer_calls_are_an_interval_apart_and_every_trajectory_arrives() -> None:
    """The run loop returns finished work and leases in one call (``put_and_lease_async``), at
    most one call per ``buffer_call_interval_s``; nothing is held back for good."""
    import time

    from miles.actors.handles import Peer

    async def scenario() -> tuple[list[tuple[float, str]], int]:
        worker, buf, _ = _worker(partial=False, max_len=6)
        calls: list[tuple[float, str]] = []

        class Counting:
            def __getattr__(self, name: str):
                fn = getattr(buf, name)
                if name not in ("put_and_lease", "put_and_lease_async", "put_many", "lease", "lease_async"):
                    return fn

                def counted(*args, **kwargs):
                    calls.append((time.monotonic(), name))
                    return fn(*args, **kwargs)
                return counted

        worker.buffer = Peer(Counting())
        worker.buffer_call_interval_s = 0.1
        buf.add_prompts(_prompts(4))  # 8 trajectories, 4 in flight at most
        run = asyncio.create_task(worker.run())
        while buf.ledger().ready < 8:
            await asyncio.sleep(0.01)
        await worker.stop()
        await run
        await worker.engine.close()
        return calls, buf.ledger().ready

    calls, ready = asyncio.run(scenario())
    assert ready == 8
    gaps = [b[0] - a[0] for a, b in zip(calls, calls[1:])]
    assert min(gaps) >= 0.1 - 0.005, gaps
    assert {name for _, name in calls} <= {"put_and_lease_async", "put_many"}  # never a lease call of its own


def test_a_starved_worker_waits_in_one_lease_call_and_starts_when_work_arrives() -> None:
    """Nothing to lease: one call that waits in the buffer (no poll every interval), answered
    by the admission; a stop ends the next wait, and nothing stays leased or waiting."""
    from miles.actors.handles import Peer

    async def scenario() -> tuple[list[str], list[str], int]:
        worker, buf, _ = _worker(partial=False, max_len=6)
        worker.lease_wait_s = 60.0  # only an admission or the stop can end a wait
        calls: list[str] = []

        class Counting:
            def __getattr__(self, name: str):
                fn = getattr(buf, name)

                def counted(*args, **kwargs):
                    calls.append(name)
                    return fn(*args, **kwargs)
                return counted

        worker.buffer = Peer(Counting())
        run = asyncio.create_task(worker.run())
        while not buf._lease_waiters:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # ten call intervals: a polling worker would call ten times
        before = list(calls)
        buf.add_prompts(_prompts(1))
        while buf.ledger().ready < 2:
            await asyncio.sleep(0.01)
        while not buf._lease_waiters:  # starved again
            await asyncio.sleep(0.01)
        await asyncio.wait_for(worker.stop(), 10.0)
        await asyncio.wait_for(run, 10.0)
        await worker.engine.close()
        return before, buf.leased("w0"), len(buf._lease_waiters)

    before, leased, waiters = asyncio.run(scenario())
    assert before == ["put_and_lease_async"]
    assert leased == [] and waiters == 0


def test_work_leased_after_the_worker_stopped_taking_it_goes_back_unstarted() -> None:
    async def scenario() -> tuple[int, int, int]:
        worker, buf, _ = _worker(partial=False)
        buf.add_prompts(_prompts(1))
        leased = buf.lease("w0", 2)  # as a waiting lease that answered after the stop began
        worker._stopping = True
        await worker._start(leased)
        await worker.engine.close()
        ledger = buf.ledger()
        ledger.check()
        return len(worker._inflight), ledger.queued, ledger.in_flight

    assert asyncio.run(scenario()) == (0, 2, 0)
