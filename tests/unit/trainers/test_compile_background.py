"""The compiled trainer's warm-up in a child process (``--compile-warmup background``): the
first steps run eagerly, the layers switch to compiled between steps once the child is done,
and the in-process compile then finds the child's graphs in torch's on-disk caches."""

from __future__ import annotations

import pytest
import torch

from miles.algorithms import AlgorithmConfig
from miles.trainers import EmbeddedTrainer, TrainerConfig, compilation, embedded
from tests.compile_child import expect_failed_child_reported
from tests.marks import real_compile
from tests.unit.trainers.conftest import make_model, random_groups, set_behaviour


class _FakeChild:
    """Done after ``polls`` polls; counts them. Stands in for the child process."""

    def __init__(self, trainer: EmbeddedTrainer, polls: int = 2, ok: bool = True) -> None:
        self.polls, self.result, self.seconds, self.warmup_s, self.stopped = polls, ok, 7.0, 5.0, False

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def ok(self) -> bool:
        return self.result

    def stop(self) -> None:
        self.stopped = True


def test_background_warmup_switches_to_compiled_between_steps(monkeypatch) -> None:
    """Eager until the child is done, then compiled from the next step's start (the compile
    and the warm-up run before the step, never inside it); the warm-up's figures are
    reported once, with the step that first ran compiled."""
    events: list[str] = []
    monkeypatch.setattr(embedded, "BackgroundCompile", lambda tr: _FakeChild(tr, polls=2))
    monkeypatch.setattr(compilation, "compile_layers", lambda model: events.append("compile"))
    monkeypatch.setattr(compilation, "warm_up", lambda tr: events.append("warm"))
    monkeypatch.setattr(compilation, "log_recompiles", lambda: None)
    tr = EmbeddedTrainer(make_model(), config=TrainerConfig(lr=1e-3, compile=True, compile_warmup="background"),
                         algo=AlgorithmConfig())
    assert not tr.compiled and events == []  # nothing compiled before the first step
    forward = tr._forward

    def spy(*args, **kw):
        events.append("fwd-compiled" if tr.compiled else "fwd-eager")
        return forward(*args, **kw)

    monkeypatch.setattr(tr, "_forward", spy)
    seen = []
    for step in range(5):
        groups = random_groups(seed=step)
        set_behaviour(tr, groups)
        events.append(f"step{step + 1}")
        seen.append(tr.train_step(groups))
    assert [m["perf/compiled"] for m in seen] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert [m.get("perf/compiled_from_step") for m in seen] == [None, None, 3.0, None, None]
    assert seen[2]["perf/compile_background_s"] == 7.0 and seen[2]["perf/compile_warmup_s"] >= 0.0
    # the switch lies between step 2's last forward and step 3's first
    i = events.index("compile")
    assert events[i - 1] == "step3" and events[i + 1] == "warm"
    assert "fwd-compiled" not in events[:i] and "fwd-eager" not in events[i:]


def test_compile_warmup_auto_is_inline_on_the_cpu(monkeypatch) -> None:
    """auto: the child on CUDA only (on the CPU it would take the eager steps' cores);
    inline compiles at construction, as before."""
    children = []
    monkeypatch.setattr(embedded, "BackgroundCompile", lambda tr: children.append(tr) or _FakeChild(tr))
    monkeypatch.setattr(compilation, "warm_up", lambda tr: None)
    tr = EmbeddedTrainer(make_model(), config=TrainerConfig(lr=1e-3, compile=True), algo=AlgorithmConfig())
    assert tr.compiled and children == []
    assert all(layer._compiled_call_impl is not None for layer in tr.model.model.layers)
    tr = EmbeddedTrainer(make_model(), config=TrainerConfig(lr=1e-3, compile=True, compile_warmup="background"),
                         algo=AlgorithmConfig())
    assert not tr.compiled and len(children) == 1
    assert all(layer._compiled_call_impl is None for layer in tr.model.model.layers)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the child fails for want of CUDA")
def test_a_failed_child_is_reported_with_its_log(caplog) -> None:
    """The child process as the trainer starts it (its spec, its imports); one that fails (a
    CUDA trainer on a machine without CUDA) is reported with the tail of its log, and the
    trainer then compiles in-process."""
    from types import SimpleNamespace

    from miles.trainers.compile_cache import BackgroundCompile

    owner = SimpleNamespace(model=make_model(), config=TrainerConfig(device="cuda", compile=True),
                            algo=AlgorithmConfig())
    expect_failed_child_reported(BackgroundCompile(owner), caplog)  # type: ignore[arg-type]


@real_compile
def test_child_fills_the_caches_the_switch_reads(monkeypatch, tmp_path) -> None:
    """The real child process on the CPU, with fresh cache directories: once it is done, the
    trainer's own compile finds every inductor graph in the FX graph cache (no miss), and
    the compiled steps train as an eager twin does."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    torch._dynamo.reset()
    counters.clear()
    shape = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    cfg = TrainerConfig(lr=1e-2, compile=True, compile_warmup="background", max_tokens_per_micro_batch=24)
    tr = EmbeddedTrainer(make_model(**shape), config=cfg, algo=AlgorithmConfig(use_tis=True))
    twin = EmbeddedTrainer(make_model(**shape), config=TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=24),
                           algo=AlgorithmConfig(use_tis=True))
    child = tr._background
    assert child is not None
    after_warmup: dict[str, int] = {}
    warm_up = compilation.warm_up

    def counted(trainer: EmbeddedTrainer) -> None:  # the switch's warm-up, counted on its own
        warm_up(trainer)
        after_warmup.update(counters["inductor"])

    monkeypatch.setattr(compilation, "warm_up", counted)
    child.proc.wait(timeout=540)
    assert child.proc.returncode == 0, child.log_path.read_text()[-2000:]
    for step in range(2):
        groups = random_groups(seed=step)
        set_behaviour(twin, groups, shift=0.1)
        a = twin.train_step(groups)
        b = tr.train_step(groups)
        assert b["perf/compiled"] == 1.0
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
        tr.model.load_state_dict(twin.model.state_dict())
    # every graph the switch's warm-up compiled came from the child's cache (the steps after
    # it may still meet a class this tiny shape's warm-up misses: heads = rows = 2 duck-sizes)
    assert after_warmup.get("fxgraph_cache_hit", 0) > 0
    assert after_warmup.get("fxgraph_cache_miss", 0) == 0
