"""A trainer whose decoder layers run under torch.compile trains exactly as the eager one,
over micro-batches of changing shapes (RL batches: every step's lengths differ)."""

from __future__ import annotations

import shutil

import pytest
import torch

from miles.algorithms import AlgorithmConfig
from miles.trainers import EmbeddedTrainer, TrainerConfig, compilation
from tests.unit.trainers.conftest import make_model, random_groups, set_behaviour

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="inductor on the CPU needs a C++ compiler")


def _trainer(compiled: bool) -> EmbeddedTrainer:
    # a small token budget per micro-batch: each step runs several micro-batches of
    # different (rows, length) shapes through the compiled layers
    cfg = TrainerConfig(lr=1e-2, compile=compiled, max_tokens_per_micro_batch=24)
    return EmbeddedTrainer(make_model(), config=cfg, algo=AlgorithmConfig(use_tis=True))


def test_compiled_trainer_matches_eager_over_changing_shapes() -> None:
    eager, compiled = _trainer(False), _trainer(True)
    shapes: set[tuple[int, ...]] = set()  # what the layers see (both trainers plan alike)
    eager.model.model.layers[0].register_forward_pre_hook(lambda _m, args: shapes.add(tuple(args[0].shape)))
    for step in range(3):
        groups = random_groups(seed=step)
        set_behaviour(eager, groups, shift=0.1)
        flat = [t for g in groups for t in g]
        for x, y in zip(eager.compute_logprobs(flat), compiled.compute_logprobs(flat)):
            assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)
        a = eager.train_step(groups)
        b = compiled.train_step(groups)
        assert a["train/optimizer_steps"] == b["train/optimizer_steps"] == step + 1
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
        # AdamW turns float noise in near-zero gradients into full-size updates: compare
        # each step from the same weights rather than letting the copies drift apart
        compiled.model.load_state_dict(eager.model.state_dict())
    assert len(shapes) >= 4, shapes


def test_compiled_layers_share_their_graphs() -> None:
    """Each decoder layer must reuse the same compiled graphs: a per-layer guard (the layer's
    index read inside the graph) recompiled every layer, and past dynamo's limit of 8 the
    deeper layers of a real model silently ran eager."""
    from torch._dynamo.utils import counters

    graphs = []
    for layers in (2, 5):
        torch._dynamo.reset()
        counters.clear()
        tr = EmbeddedTrainer(make_model(num_hidden_layers=layers),
                             config=TrainerConfig(lr=1e-3, compile=True, max_tokens_per_micro_batch=24),
                             algo=AlgorithmConfig())
        groups = random_groups()
        set_behaviour(tr, groups)
        tr.train_step(groups)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] > 0, graphs


def test_compile_is_off_by_default_on_the_cpu(monkeypatch) -> None:
    """None = auto: a dense model on one GPU compiles; on the CPU the layers stay eager
    unless asked (--compile). (Which layers are wrapped is decided before the warm-up, which
    the other tests here run: skipped.)"""
    monkeypatch.setattr(compilation, "warm_up", lambda trainer: None)

    def compiled(flag: bool | None) -> list[bool]:
        tr = EmbeddedTrainer(make_model(), config=TrainerConfig(lr=1e-3, compile=flag), algo=AlgorithmConfig())
        return [layer._compiled_call_impl is not None for layer in tr.model.model.layers]

    assert not any(compiled(None)) and not any(compiled(False))
    assert all(compiled(True))


def test_compiled_trainer_meets_no_new_shape_class_after_construction() -> None:
    """Dynamo specializes a size-1 dimension: the first micro-batch of one row recompiled the
    layers in the middle of a run (a 15 s step on the H200); and inductor guards its kernels
    on size thresholds (on the CPU, rows × tokens ≤ 1024), so the first long micro-batch
    recompiled too, and so did one between two thresholds that a ×4 warm-up ladder stepped
    over. The trainer compiles every shape class and size regime when it is built, so steps
    and log-prob passes of any rows, short or long, compile nothing."""
    from torch._dynamo.utils import counters

    from tests.unit.trainers.conftest import make_traj

    torch._dynamo.reset()
    counters.clear()
    # hidden 32: inductor's CPU guards for it sit at rows × tokens 2048 and 4096
    model = make_model(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16)
    tr = EmbeddedTrainer(model, config=TrainerConfig(lr=1e-3, compile=True, max_tokens_per_micro_batch=8192),
                         algo=AlgorithmConfig())
    built = counters["stats"]["unique_graphs"]
    assert built > 0
    alone = [[make_traj("a", 0, [5, 6, 7], list(range(10, 40)), reward=1.0)]]  # one row per micro-batch
    groups = random_groups(seed=3)  # several rows per micro-batch
    long = [[make_traj(f"l{i}", 0, [5, 6, 7], [(11 * j + i) % 60 + 3 for j in range(400 - 9 * i)], reward=float(i % 2))
             for i in range(4)]]  # one micro-batch of 4 × 400 tokens: past the CPU's 1024

    def rows(n: int, length: int) -> list[list]:  # one micro-batch of n rows
        return [[make_traj(f"r{n}_{i}", 0, [5, 6], [(7 * j + i) % 60 + 3 for j in range(length - i)], reward=float(i % 2))
                 for i in range(n)]]

    bands = [rows(8, 200), rows(8, 380), rows(8, 700)]  # 1.6k, 3k, 5.6k tokens: between the ladder's ×4 steps
    for batch in (alone, groups, long, *bands, alone):
        set_behaviour(tr, batch)
        tr.train_step(batch)
        tr.compute_logprobs([t for g in batch for t in g])
    assert counters["stats"]["unique_graphs"] == built
    # and no compiled function reached dynamo's limit (past it, new shapes run eager)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    layer = tr.model.model.layers[0]
    for fn in (type(layer).forward, type(layer.self_attn).forward):
        assert 0 < len(_debug_get_cache_entry_list(fn.__code__)) < torch._dynamo.config.recompile_limit


def test_warm_up_shapes_climb_to_the_largest_micro_batch() -> None:
    """One row and several at each size, ×2 apart, up to the micro-batch token budget; no
    row longer than the model's context (more rows instead)."""
    def shapes(max_tokens: int | None, context: int) -> list[tuple[int, int]]:
        tr = EmbeddedTrainer(make_model(max_position_embeddings=context),
                             config=TrainerConfig(lr=1e-3, compile=False, max_tokens_per_micro_batch=max_tokens),
                             algo=AlgorithmConfig())
        return tr.warm_shapes()

    assert shapes(24, 1024) == [(2, 12), (1, 24)]
    ladder = shapes(4096, 1024)
    assert {r for r, _ in ladder} >= {1, 2} and max(r * n for r, n in ladder) == 4096
    assert all(n <= 1024 for _, n in ladder) and (4, 1024) in ladder
    sizes = sorted({r * n for r, n in ladder})
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:]))  # no gap wider than ×2
    assert max(r * n for r, n in shapes(None, 40960)) == compilation.WARM_DEFAULT_TOKENS


def test_the_warm_up_batches_carry_routes_under_routing_replay() -> None:
    """The warm-up's made-up trajectories carry routes when routing replay is on (the
    batch builder refuses a trajectory without them)."""
    model = make_model(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, model_type="qwen3_moe")
    tr = EmbeddedTrainer(model, config=TrainerConfig(lr=1e-3, use_rollout_routing_replay=True), algo=AlgorithmConfig())
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr._warm_compiled()  # eager here (compiling an MoE on the CPU takes minutes): the same batches
    assert tr.optimizer_steps == 0 and all(p.grad is None for p in tr.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
