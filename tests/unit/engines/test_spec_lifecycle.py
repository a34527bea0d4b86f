"""Speculation through the engine's life cycle: abort + resume, policy weight updates in the
middle of a generation (per-token versions), draft weight updates in the middle of a
generation (draft version only), the drafters' cache bookkeeping across plain steps,
rounds and flushes, and the rule that switches speculation on and off."""

from __future__ import annotations

import asyncio
import copy
import itertools
import math
import random
import time
from collections.abc import Callable

import pytest
import torch

from miles.engines import WeightError
from miles.engines.spec import SpeculativeConfig
from miles.engines.spec.controller import SpecController
from miles.models import token_logprobs
from miles.types import GenerateRequest, SamplingParams

from .helpers import make_model, prompts, run
from .spec_helpers import full_logprobs, generate_all, noisy_copy, spec_engine

SEEDED = SamplingParams(max_new_tokens=160, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)


async def _wait_progress(engine, rid: str, at_least: int, task: asyncio.Task) -> int:
    """Poll until ``rid`` has ``at_least`` tokens (fail, rather than hang, if it finished)."""
    while (n := engine.progress(rid)) is None or n < at_least:
        assert not task.done(), f"{rid} finished before the test could interrupt it (a loaded machine?)"
        await asyncio.sleep(0.0005)
    return n


@pytest.mark.parametrize("mode", ["coupled", "rejection"])
@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_abort_then_resume_reproduces(kind: str, mode: str) -> None:
    """Every token comes from a step, aborts land between steps, and the draws are keyed by
    (seed, position): with a fixed k a resumed request continues exactly as before."""
    policy = make_model(seed=1)
    prompt, other = prompts(2, seed=3)

    async def go():
        engine = spec_engine(policy, kind, mode=mode)
        full = await engine.generate(GenerateRequest(rid="full", input_ids=prompt, sampling=SEEDED))
        noise = asyncio.create_task(engine.generate(GenerateRequest(
            rid="other", input_ids=other, sampling=SamplingParams(max_new_tokens=80, ignore_eos=True))))
        task = asyncio.create_task(engine.generate(GenerateRequest(rid="a", input_ids=prompt, sampling=SEEDED)))
        await _wait_progress(engine, "a", 10, task)
        await engine.abort("a")
        part = await task
        rest = await engine.generate(GenerateRequest(rid="a2", input_ids=prompt + part.output_ids,
                                                     sampling=SEEDED, num_prefix_tokens=len(part.output_ids)))
        await noise
        await engine.close()
        return full, part, rest

    full, part, rest = run(go)
    assert part.finish_reason == "abort" and 10 <= len(part.output_ids) < 160
    assert part.output_ids + rest.output_ids == full.output_ids
    assert max(abs(a - b) for a, b in zip(part.logprobs + rest.logprobs, full.logprobs)) < 1e-5


@pytest.mark.parametrize("keep_kv_cache", [False, True])
@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_policy_update_mid_generation_records_versions(kind: str, keep_kv_cache: bool) -> None:
    old, new = make_model(seed=1), make_model(seed=2)
    new_weights = {k: v.clone() for k, v in new.state_dict().items()}
    prompt = prompts(1, seed=4)[0]
    sp = SamplingParams(max_new_tokens=120, temperature=1.0, seed=3, ignore_eos=True)

    async def go():
        engine = spec_engine(old, kind)
        task = asyncio.create_task(engine.generate(GenerateRequest(rid="a", input_ids=prompt, sampling=sp)))
        await _wait_progress(engine, "a", 8, task)
        await engine.pause()
        k = engine.progress("a")
        await engine.update_weights(new_weights.items(), version=1, keep_kv_cache=keep_kv_cache)
        await engine.resume()
        out = await task
        await engine.close()
        return k, out, engine

    k, out, engine = run(go)
    assert out.versions == [0] * k + [1] * (120 - k)
    assert engine.draft_version == 0  # a policy update leaves the draft alone
    lp_old = full_logprobs(old, prompt, out)
    lp_new = full_logprobs(new, prompt, out)
    got = torch.tensor(out.logprobs)
    assert (got[:k] - lp_old[:k]).abs().max() < 1e-5
    if not keep_kv_cache:  # recomputed context: exactly the new policy's log-probs
        assert (got[k:] - lp_new[k:]).abs().max() < 1e-5
    assert set(engine.spec_stats()) == {0, 1}  # acceptance is tracked per policy version


def test_draft_update_mid_generation_changes_only_the_draft() -> None:
    policy = make_model(seed=5)
    prompt = prompts(1, seed=6)[0]
    sp = SamplingParams(max_new_tokens=200, temperature=1.0, seed=9, ignore_eos=True)
    bad_draft = noisy_copy(policy, 0.4, seed=2)  # same shape as the policy, mostly wrong
    exact = {k: v.clone() for k, v in policy.state_dict().items()}

    async def go():
        engine = spec_engine(policy, "draft", draft=bad_draft, k=4)
        task = asyncio.create_task(engine.generate(GenerateRequest(rid="a", input_ids=prompt, sampling=sp)))
        await _wait_progress(engine, "a", 30, task)
        await engine.pause()
        before = engine.stats()
        with pytest.raises(WeightError, match="not a parameter"):
            engine.stage_draft_weights([("model.nope", torch.zeros(1))])
        await engine.update_draft_weights(exact.items(), version=1)
        assert engine.draft_version == 1 and engine.version == 0
        await engine.resume()
        out = await task
        after = engine.stats()
        await engine.close()
        return out, before, after

    out, before, after = run(go)
    assert out.versions == [0] * 200
    assert (torch.tensor(out.logprobs) - full_logprobs(policy, prompt, out)).abs().max() < 1e-5
    rate_before = before["spec/accepted"] / before["spec/drafted"]
    rate_after = (after["spec/accepted"] - before["spec/accepted"]) / (after["spec/drafted"] - before["spec/drafted"])
    assert rate_before < 0.8 and rate_after > 0.99
    assert after["spec/draft_version"] == 1.0 and after["engine/draft_updates"] == 1.0


def _schedule(engine, pattern):
    """Replace the controller's choice with a fixed cycle of options (0 = plain step)."""
    cycle = itertools.cycle(pattern)
    engine.spec.plan = lambda n: next(cycle)


@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_drafter_cache_follows_plain_steps_rounds_and_flushes(kind: str) -> None:
    """The draft's logits at each catch-up equal a full, cache-free forward of the draft over
    the true context — after plain steps (and the flushes they force), rounds, slot moves."""
    policy = make_model(seed=7)
    engine = spec_engine(policy, kind, max_batch_size=3)
    _schedule(engine, [3, 2] + [0] * 35)  # two rounds, then 35 plain steps (> one flush)
    drafter = engine.spec.drafter
    ref_draft = copy.deepcopy(drafter.model)
    seen: list[tuple[list[list[int]], torch.Tensor]] = []
    inner = drafter.catch_up

    def spy(*args):
        logits, state = inner(*args)  # called on the stepping thread, rows = the running batch
        seen.append(([list(r.context) for r in engine.stepper.running], logits.clone()))
        return logits, state

    drafter.catch_up = spy
    ps = prompts(5, seed=8)
    sps = [SamplingParams(max_new_tokens=60 + 25 * (i % 3), seed=i, ignore_eos=True) for i in range(5)]
    generate_all(engine, [GenerateRequest(rid=str(i), input_ids=p, sampling=s) for i, (p, s) in enumerate(zip(ps, sps))])
    assert len(seen) > 4
    worst = 0.0
    for contexts, logits in seen:
        for ctx, row in zip(contexts, logits):
            worst = max(worst, (row - _reference_draft_logits(kind, ref_draft, policy, ctx)).abs().max().item())
    assert worst < 1e-4


def _reference_draft_logits(kind: str, draft, policy, ctx: list[int]) -> torch.Tensor:
    ids = torch.tensor([ctx])
    with torch.no_grad():
        if kind == "draft":
            return draft(ids).logits[0, -1]
        h = policy(ids, return_hidden=True).hidden  # entries i = (h_i, x_{i+1}), i < len - 1
        feats = draft(h[:, :-1], ids[:, 1:], policy.model.embed_tokens)
        return policy.lm_head(feats[0, -1]).float()


def test_batch_size_cap_switches_speculation_off() -> None:
    policy = make_model(seed=9)
    engine = spec_engine(policy, "draft", spec={"speculative_max_batch_size": 2})
    sizes: list[tuple[int, int]] = []
    plan = engine.spec.plan
    engine.spec.plan = lambda n: sizes.append((n, k := plan(n))) or k
    ps = prompts(6, seed=10)
    sps = [SamplingParams(max_new_tokens=10 + 12 * i, seed=i, ignore_eos=True) for i in range(6)]
    generate_all(engine, [GenerateRequest(rid=str(i), input_ids=p, sampling=s) for i, (p, s) in enumerate(zip(ps, sps))])
    assert all(k == 0 for n, k in sizes if n > 2)
    assert any(k > 0 for n, k in sizes if n <= 2)


def test_an_lm_draft_is_fed_only_when_speculation_resumes() -> None:
    # Above the cap plain steps feed an independent draft nothing (its backlog is context
    # tokens, fed at the next round); the round after a plain stretch far longer than the
    # old flush interval (31 steps) catches the draft up and the tokens stay plain
    # decoding's (coupled mode). EAGLE keeps its bounded flushes (hidden states in a buffer).
    from miles.engines.spec.drafters import CAPACITY

    from .helpers import make_engine

    policy = make_model(seed=9)
    engine = spec_engine(policy, "draft", mode="coupled", spec={"speculative_max_batch_size": 2})
    flushes, in_round = [], []  # (fed during a round?, the longest backlog fed)
    drafter, run = engine.spec.drafter, engine.spec.run
    flush = drafter.flush
    drafter.flush = lambda rows: flushes.append((bool(in_round), max(map(drafter.pending, rows)))) or flush(rows)

    def round_(*a, **kw):
        in_round.append(True)
        try:
            return run(*a, **kw)
        finally:
            in_round.pop()

    engine.spec.run = round_
    ps = prompts(4, seed=10)
    sps = [SamplingParams(max_new_tokens=n, seed=i, ignore_eos=True) for i, n in enumerate((120, 120, 50, 50))]
    reqs = [GenerateRequest(rid=str(i), input_ids=p, sampling=s) for i, (p, s) in enumerate(zip(ps, sps))]
    outs = generate_all(engine, reqs)
    plain = generate_all(make_engine(policy), reqs)
    assert [o.output_ids for o in outs] == [o.output_ids for o in plain]
    assert flushes and all(during for during, _ in flushes)  # nothing fed between rounds
    assert max(n for _, n in flushes) > CAPACITY  # the first round fed the whole backlog at once
    assert engine.spec.flush_s >= 0.0
    assert engine.stats()["spec/rounds"] > 0


def _simulated_step(c: SpecController, alpha: float, rng: random.Random) -> int:
    """One step of batch 8 under ``c``: a plain step costs 1 s, a round 1 + 0.2 k s, and each
    row keeps each next draft with probability ``alpha`` until its first rejection."""
    k = c.choose(8)
    if k == 0:
        c.observe_plain(8, 1.0, 8)
    else:
        outcomes = []
        for _ in range(8):
            a = 0
            while a < k and rng.random() < alpha:
                a += 1
            outcomes.append((k, a))
        c.observe_round(8, k, 1.0 + 0.2 * k, 0, outcomes, sum(a + 1 for _, a in outcomes))
    return k


def test_controller_rule() -> None:
    cfg = SpeculativeConfig(speculative_algorithm="draft", speculative_num_steps=3, speculative_probe_interval=10)
    c = SpecController(cfg)
    alpha = 0.8  # a round costs 1 + 0.2 k plain steps; drafts are accepted 80% of the time

    rng = random.Random(0)

    def step() -> int:
        return _simulated_step(c, alpha, rng)

    assert sorted(step() for _ in range(12)) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # warm-up: 3 each
    picks = [step() for _ in range(40)]
    best = max((1, 2, 3), key=lambda k: c.rate(8, k))
    assert c.rate(8, best) > c.rate(8, 0)
    assert picks[-20:].count(best) >= 17  # the best option, apart from a probe every 10 steps
    alpha = 0.0  # the draft stops being accepted: plain decoding wins
    late = [step() for _ in range(200)][-30:]
    assert late.count(0) >= 26
    assert c.choose(1) in (0, 1, 2, 3)  # an unmeasured batch size starts its own warm-up
    capped = SpecController(SpeculativeConfig(speculative_algorithm="draft", speculative_max_batch_size=4))
    assert capped.choose(5) == 0
    fixed = SpecController(SpeculativeConfig(speculative_algorithm="draft", speculative_adaptive=False,
                                             speculative_num_steps=5))
    assert {fixed.choose(n) for n in (1, 7, 64)} == {5}


def test_controller_backs_off_probing_while_its_choice_holds() -> None:
    """Probes that confirm the choice double the interval (up to MAX_BACKOFF×); a probe that
    finds a better option resets it, so a draft that becomes good is still picked up."""
    from miles.engines.spec.controller import MAX_BACKOFF

    c = SpecController(SpeculativeConfig(speculative_algorithm="draft", speculative_num_steps=2,
                                         speculative_probe_interval=10))
    alpha = 0.0

    rng = random.Random(0)

    def step() -> int:
        return _simulated_step(c, alpha, rng)

    picks = [step() for _ in range(1000)]
    spec_after_warmup = sum(k != 0 for k in picks[9:])
    assert 6 <= spec_after_warmup <= 12  # probes at +10, +20, +40, +80, +160, then every 160
    assert c.interval[8] == MAX_BACKOFF * 10
    assert c.stats(0)["spec/probes"] == spec_after_warmup
    alpha = 0.9  # the draft got good: the next probe finds it, a trial confirms, the interval resets
    later, intervals = [], []
    for _ in range(2 * MAX_BACKOFF * 10):
        later.append(step())
        intervals.append(c.interval[8])
    assert later[-50:].count(0) <= 10
    assert min(intervals) == 10 and c.stats(0)["spec/trials"] >= 1


def test_controller_does_not_flip_on_noise() -> None:
    """Two options within a few percent of each other: the rule stays with the one it has;
    a clearly faster one (≥ 5%) takes over."""
    c = SpecController(SpeculativeConfig(speculative_algorithm="draft", speculative_num_steps=1,
                                         speculative_probe_interval=1000))
    never = [(1, 0)] * 8  # every draft rejected: a round emits one token per row, like a plain step
    for _ in range(3):
        c.observe_plain(8, 1.00, 8)
        c.observe_round(8, 1, 1.01, 0, never, 8)
    c.accept.reach[1], c.accept.kept[1] = 1e9, 0.0  # no prior left: p_1 = 0
    c.steps = 6
    assert c.choose(8) == 0
    for seconds in (0.99, 0.985, 0.98):  # the round is now measured 1-2% faster
        c.observe_round(8, 1, seconds, 0, never, 8)
    assert [c.choose(8) for _ in range(10)] == [0] * 10
    for _ in range(9):
        c.observe_round(8, 1, 0.8, 0, never, 8)
    assert c.choose(8) == 1


def test_controller_trial_replaces_stale_measurements() -> None:
    """Plain steps measured slow while the engine was cold, then 2× faster: the first probe
    that sees it starts a trial of fresh measurements, and the rule switches right after,
    instead of waiting for probes to outvote the stale median (rule 4)."""
    c = SpecController(SpeculativeConfig(speculative_algorithm="draft", speculative_num_steps=1,
                                         speculative_probe_interval=10))
    plain_s = 2.0  # cold: slower than a round of k = 1 that emits 1.5 tokens per row in 1.2 s

    def step() -> int:
        k = c.choose(8)
        if k == 0:
            c.observe_plain(8, plain_s, 8)
        else:
            c.observe_round(8, 1, 1.2, 0, [(1, 1)] * 4 + [(1, 0)] * 4, 12)
        return k

    warm = [step() for _ in range(6)]
    assert sorted(warm) == [0, 0, 0, 1, 1, 1]
    assert [step() for _ in range(5)] == [1] * 5
    plain_s = 0.5  # warmed up: plain is now 2.5× the round's rate
    picks = [step() for _ in range(20)]
    first_probe = picks.index(0)
    assert picks[first_probe : first_probe + 3] == [0, 0, 0]  # the probe and its trial
    after = picks[first_probe + 3 :]
    assert after[:5] == [0] * 5 and after.count(1) <= 2  # switched; k = 1 only as a probe now
    assert c.stats(0)["spec/trials"] == 1


def test_rates_leave_out_graph_captures() -> None:
    """A step or round during which a CUDA graph was captured reports its time without the
    capture (a one-time cost of a new shape) to the adaptive rule."""
    from miles.engines.runner import GRAPH_CAPTURES

    engine = spec_engine(make_model(seed=13), "draft")
    _schedule(engine, [0, 2])
    seen: list[float] = []
    controller, runner = engine.spec.controller, engine.stepper.runner
    plain, rnd = controller.observe_plain, controller.observe_round
    controller.observe_plain = lambda b, seconds, *a: (seen.append(seconds), plain(b, seconds, *a))
    controller.observe_round = lambda b, k, seconds, *a, **kw: (seen.append(seconds), rnd(b, k, seconds, *a, **kw))
    decode, verify = runner.decode, runner.verify

    captures = [0]

    def capturing(inner):
        def call(*args, **kwargs):
            if captures[0] < 4:  # the first four forwards capture: 0.6 s each, recorded as such
                captures[0] += 1
                time.sleep(0.6)
                GRAPH_CAPTURES["seconds"] += 0.6
            return inner(*args, **kwargs)
        return call

    runner.decode, runner.verify = capturing(decode), capturing(verify)
    short = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    generate_all(engine, [GenerateRequest(rid="c", input_ids=prompts(1, seed=14)[0], sampling=short)])
    # the steps that captured would report >= 0.6 s; the margin to 0.4 s absorbs a loaded
    # machine's hiccups (one step of a 2-core CI run took 0.17 s besides its capture)
    assert captures[0] == 4 and len(seen) >= 4 and max(seen) < 0.4


def test_plain_logprobs_unchanged_by_attached_draft() -> None:
    """A request decoded by plain steps only (speculation off by the rule) is unaffected."""
    policy = make_model(seed=11)
    engine = spec_engine(policy, "eagle")
    _schedule(engine, [0])
    p = prompts(1, seed=12)[0]
    out = generate_all(engine, [GenerateRequest(rid="x", input_ids=p, sampling=SEEDED)])[0]
    assert out.spec_verify_count == 0
    assert (torch.tensor(out.logprobs) - token_logprobs_from(policy, p, out)).abs().max() < 1e-5


def token_logprobs_from(policy, prompt, out) -> torch.Tensor:
    from miles.engines.sampling import truncate

    ids = torch.tensor([prompt + out.output_ids])
    with torch.no_grad():
        logits = policy(ids).logits[0, len(prompt) - 1 : -1]
    kept = truncate(logits, torch.full((len(out.output_ids),), -1), torch.full((len(out.output_ids),), 0.9))
    return token_logprobs(kept, torch.tensor(out.output_ids))


def test_a_backlog_feed_is_not_counted_as_the_rounds_cost() -> None:
    """The round after plain steps first feeds the draft their backlog: that is the switch's
    cost, so the controller's measured round time leaves it out (counted in, it made every
    probe after a plain stretch look slower than speculation is)."""
    import time

    policy = make_model(seed=9)
    engine = spec_engine(policy, "draft", spec={"speculative_max_batch_size": 2})
    drafter, controller = engine.spec.drafter, engine.spec.controller
    flush, observe = drafter.flush, controller.observe_round
    drafter.flush = lambda rows: time.sleep(0.3) or flush(rows)  # a slow feed
    rounds: list[tuple[float, float]] = []  # (seconds the controller saw, the feed's seconds)
    controller.observe_round = lambda b, k, seconds, *a, **kw: (
        rounds.append((seconds, engine.spec.flush_s)) or observe(b, k, seconds, *a, **kw))
    ps = prompts(4, seed=10)
    sps = [SamplingParams(max_new_tokens=n, seed=i, ignore_eos=True) for i, n in enumerate((60, 60, 20, 20))]
    generate_all(engine, [GenerateRequest(rid=str(i), input_ids=p, sampling=s) for i, (p, s) in enumerate(zip(ps, sps))])
    fed = [(seconds, feed) for seconds, feed in rounds if feed > 0]
    assert fed and all(feed >= 0.3 and seconds < 0.3 for seconds, feed in fed), fed


def _batch1_speedup(seed: int, steps: int, kept: Callable[[random.Random, int], int],
                    cost: float) -> tuple[float, SpecController]:
    """The rule at batch 1 over ``steps`` steps: a plain step takes 1 s and emits a token; a
    round of k drafts takes 1 + ``cost`` k s and keeps ``kept(rng, k)`` of them (+ 1 token).
    Returns tokens per second (× plain decoding) and the controller."""
    rng = random.Random(seed)
    c = SpecController(SpeculativeConfig(speculative_algorithm="draft", speculative_num_steps=4,
                                         speculative_probe_interval=20))
    tokens = seconds = 0.0
    for _ in range(steps):
        k = c.choose(1)
        if k == 0:
            c.observe_plain(1, 1.0, 1)
            emitted, s = 1, 1.0
        else:
            a = kept(rng, k)
            emitted, s = a + 1, 1.0 + cost * k
            c.observe_round(1, k, s, 0, [(k, a)], emitted)
        tokens, seconds = tokens + emitted, seconds + s
    return tokens / seconds, c


def test_controller_rates_skewed_rounds_by_their_mean_yield() -> None:
    """At batch 1 a round's yield is nearly bimodal: here 55% of the rounds emit one token
    and 45% all k + 1, in (1 + 0.025 k)× a plain step — k = 4 runs 2.5× plain decoding.
    The median of per-round rates (one token per round) made speculation look slower than
    plain: the H200's adaptive engine at batch 1 measured k = 4 at 266 tokens/s per row where
    always speculating ran 629. Over five seeds the rule must get ≥ 1.9× plain (the old
    median rule: 1.05-1.58×)."""
    for seed in range(5):
        speedup, c = _batch1_speedup(seed, 300, lambda rng, k: k if rng.random() < 0.45 else 0, 0.025)
        assert speedup >= 1.9, (seed, speedup, dict(c.chosen))
        assert max(c.rate(1, k) for k in (1, 2, 3, 4)) > 1.5 * c.rate(1, 0)


def test_controller_pools_acceptance_over_every_k() -> None:
    """Batch 1, acceptance falling with the draft position (p = 0.6, 0.55, 0.5, 0.5), a round
    in (1 + 0.2 k)× a plain step: k = 2 runs 1.38× plain, k = 1 1.33×, k = 3 1.31×, k = 4
    1.21×. Speculation pays, but not by much, as at batch 1 on the H200 with a fresh draft
    (always on: 1.10-1.27× plain). Each option's own ~10 rounds were too few to rank the
    options against plain there: the adaptive engine chose plain or k = 1 at 0.95× plain.
    Here the rule that kept a mean per option got 1.04× on one of twelve seeds (1.28-1.37×
    on the others); the acceptance per position, pooled over every round of every k, must
    get ≥ 1.25× on all twelve, and estimate each k's yield."""
    p = (0.6, 0.55, 0.5, 0.5)
    expected = [1 + sum(math.prod(p[:j]) for j in range(1, k + 1)) for k in (1, 2, 3, 4)]

    def kept(rng: random.Random, k: int) -> int:
        a = 0
        while a < k and rng.random() < p[a]:
            a += 1
        return a

    for seed in range(12):
        speedup, c = _batch1_speedup(seed, 400, kept, 0.2)
        assert speedup >= 1.25, (seed, speedup, dict(c.chosen))
        stats = c.stats(0)
        assert all(abs(stats[f"spec/expected_tokens_k{k}"] - e) < 0.4 for k, e in zip((1, 2, 3, 4), expected))


def test_controller_flags_probes_and_keeps_untimed_rounds_out_of_the_rates() -> None:
    """``is_probe`` marks the rule's probes; an untimed round (an eager probe) adds to the
    acceptance model, not to the option's times, and starts no trial."""
    c = SpecController(SpeculativeConfig(speculative_algorithm="draft", speculative_num_steps=1,
                                         speculative_probe_interval=5))
    rng = random.Random(1)
    flags = []
    for _ in range(40):
        _simulated_step(c, 0.0, rng)  # drafts never kept: plain decoding, and a probe of k = 1 now and then
        flags.append((c.chosen[1], c.is_probe))
    assert any(probe for _, probe in flags) and c.probes == sum(probe for _, probe in flags)
    times = c.rates.count[(8, 1)]
    reach = c.accept.reach[1]
    c.observe_round(8, 1, None, 0, [(1, 1)] * 8, 16)
    assert c.rates.count[(8, 1)] == times and c.accept.reach[1] > reach and not c.trial
