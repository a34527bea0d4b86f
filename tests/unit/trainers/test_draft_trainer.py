"""The DraftTrainer and its DraftLearner: on trajectories of a policy the draft has never
seen, training lowers the draft loss and raises the engine's acceptance; new draft versions
travel through the draft channel of a WeightBroadcaster without touching policy versions;
the policy copy is pulled from the policy channel; checkpoint state round-trips."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles.actors.draft_trainer import DraftTrainer, apply_draft_buckets
from miles.actors.weight_broadcaster import WeightBroadcaster
from miles.checkpoint import load_tree, save_tree
from miles.engines import EmbeddedEngine, EngineConfig
from miles.engines.spec import SpeculativeConfig
from miles.models.draft import build_draft
from miles.trainers.draft import DraftLearner
from miles.types import GenerateRequest, SamplingParams
from miles.transports.weights import pack_all

from .draft_helpers import bigram_policy, sample_trajectories


@pytest.fixture(scope="module")
def world():
    policy = bigram_policy(seed=0)
    return policy, sample_trajectories(policy, 96, seed=1), sample_trajectories(policy, 24, seed=2)


class _Sink:
    """A rollout worker's draft endpoint, over a bare engine."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine

    async def receive_draft_weights(self, version: int, buckets: list) -> int:
        return await apply_draft_buckets(self.engine, version, buckets)


@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_training_lowers_loss_and_raises_acceptance(world, kind: str) -> None:
    policy, train, held = world
    draft = build_draft(kind, policy.config, seed=3)
    spec = SpeculativeConfig(speculative_algorithm=kind, speculative_num_steps=3, speculative_adaptive=False)
    engine = EmbeddedEngine(copy.deepcopy(policy), config=EngineConfig(max_batch_size=24, max_seq_len=128),
                            draft=copy.deepcopy(draft), speculative=spec)
    broadcaster = WeightBroadcaster(method="receive_draft_weights")
    learner = DraftLearner(draft, policy=copy.deepcopy(policy), lr=1e-2, micro_batch_size=16)
    trainer = DraftTrainer(learner, draft_broadcaster=broadcaster, train_interval=2)
    prompts = [t.prompt_tokens for t in held]

    async def go():
        broadcaster.register("w0", _Sink(engine))
        before = learner.evaluate(held)
        rate_before = await _rate(engine, prompts)
        for _ in range(4):  # four batches of the same data: two publishes (interval 2)
            groups = [train[i : i + 4] for i in range(0, len(train), 4)]
            await trainer.add_batch(groups)
            await trainer.train_pending()
        await asyncio.sleep(0)
        while broadcaster.applied.get("w0", -1) < 2:
            await asyncio.sleep(0.01)
        rate_after = await _rate(engine, prompts)
        after = learner.evaluate(held)
        await engine.close()
        return before, after, rate_before, rate_after

    before, after, rate_before, rate_after = asyncio.run(go())
    assert trainer.counters["published"] == 2 and engine.draft_version == 2 and engine.version == 0
    assert after["draft/loss"] < before["draft/loss"] - 0.5
    assert after["draft/accept_est"] > before["draft/accept_est"] + 0.15
    assert rate_after > rate_before + 0.15
    stats = trainer.ping()
    assert stats["draft/version"] == 2 and stats["draft/trained"] == 4 * len(train)


async def _rate(engine: EmbeddedEngine, prompts: list[list[int]]) -> float:
    before = engine.stats()
    await asyncio.gather(*(engine.generate(GenerateRequest(rid=f"e{i}-{engine.draft_version}", input_ids=p,
                                                           sampling=SamplingParams(max_new_tokens=24, seed=i, ignore_eos=True)))
                           for i, p in enumerate(prompts)))
    after = engine.stats()
    return (after["spec/accepted"] - before["spec/accepted"]) / (after["spec/drafted"] - before["spec/drafted"])


def test_policy_copy_is_pulled_from_the_policy_channel() -> None:
    policy, newer = bigram_policy(seed=0), bigram_policy(seed=5)
    learner = DraftLearner(build_draft("eagle", policy.config, seed=1), policy=copy.deepcopy(policy))
    policy_channel = WeightBroadcaster()
    trainer = DraftTrainer(learner, policy_broadcaster=policy_channel)

    async def go():
        await trainer._pull_policy()  # nothing published yet: nothing changes
        assert learner.policy_version == 0
        await policy_channel.publish(3, pack_all(newer.state_dict().items(), version=3, bucket_bytes=1 << 16))
        await trainer._pull_policy()

    asyncio.run(go())
    assert learner.policy_version == 3
    for k, v in newer.state_dict().items():
        assert torch.equal(learner.policy.state_dict()[k], v), k
    assert not policy_channel.workers  # a pull consumer is nobody the sync mode waits for


def test_queue_is_bounded_and_failed_trajectories_are_skipped(world) -> None:
    from miles.types import Status

    policy, train, _ = world
    trainer = DraftTrainer(DraftLearner(build_draft("draft", policy.config)), max_queue=10)
    bad = copy.deepcopy(train[0])
    bad.status = Status.FAILED
    n = asyncio.run(trainer.add_batch([train[:8], [bad], train[8:16]]))
    assert n == 10 and trainer.counters["dropped"] == 6 and trainer.counters["received"] == 16


def test_state_roundtrip_through_a_checkpoint_tree(world, tmp_path) -> None:
    policy, train, held = world
    learner = DraftLearner(build_draft("draft", policy.config, seed=1), lr=1e-2)
    learner.train_on(train[:32])
    learner.version = 4
    save_tree(tmp_path, "draft", learner.state_dict())
    fresh = DraftLearner(build_draft("draft", policy.config, seed=2), lr=1e-2)
    fresh.load_state_dict(load_tree(tmp_path, "draft"))
    assert fresh.version == 4 and fresh.steps == learner.steps
    assert fresh.evaluate(held)["draft/loss"] == pytest.approx(learner.evaluate(held)["draft/loss"], abs=1e-6)
    fresh.train_on(train[32:48])  # the optimizer state loaded too: training goes on
    other = DraftLearner(build_draft("draft", policy.config, hidden_size=128))
    with pytest.raises(ValueError, match="shape"):
        other.load_state_dict(learner.state_dict())
    eagle = DraftLearner(build_draft("eagle", policy.config), policy=copy.deepcopy(policy))
    with pytest.raises(ValueError):
        eagle.load_state_dict(learner.state_dict())


def test_eagle_learner_needs_a_policy() -> None:
    policy = bigram_policy(seed=0)
    with pytest.raises(ValueError, match="needs a copy of the policy"):
        DraftLearner(build_draft("eagle", policy.config))
    with pytest.raises(ValueError, match="needs a copy of the policy"):
        DraftLearner(build_draft("draft", policy.config), kl_coef=0.1)
