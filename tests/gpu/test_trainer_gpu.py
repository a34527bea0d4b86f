"""EmbeddedTrainer on CUDA: bf16 autocast training, fused vs plain LM-head log-probs,
torch.compile, and the fused path's memory advantage. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from miles.algorithms import AlgorithmConfig
from miles.models import CausalLM, tiny_config, token_logprobs
from miles.trainers import EmbeddedTrainer, TrainerConfig
from tests.unit.trainers.conftest import make_traj, random_groups, set_behaviour

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _trainer(dtype: str = "bfloat16", **kw) -> EmbeddedTrainer:
    torch.manual_seed(0)
    model = CausalLM(tiny_config(initializer_range=0.1, **kw.pop("model", {})))
    return EmbeddedTrainer(model, config=TrainerConfig(lr=1e-2, device="cuda", dtype=dtype, **kw),
                           algo=AlgorithmConfig(use_tis=True))


def test_bf16_training_raises_logprob_of_rewarded_responses() -> None:
    tr = _trainer()
    groups = [[make_traj(f"{i}a", i, p, [40, 41, 42], 1.0), make_traj(f"{i}b", i, p, [50, 51], 0.0)]
              for i, p in enumerate([[5, 6, 7], [8, 9]])]
    good = [g[0] for g in groups]
    before = [sum(x) for x in tr.compute_logprobs(good)]
    for _ in range(5):
        set_behaviour(tr, groups)
        m = tr.train_step(groups)
        assert m["train/skipped_steps"] == 0.0 and all(v == v for v in m.values())
    after = [sum(x) for x in tr.compute_logprobs(good)]
    assert all(a > b for a, b in zip(after, before))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_and_plain_logprobs_agree(dtype: str) -> None:
    tr = _trainer(dtype)
    groups = random_groups()
    flat = [t for g in groups for t in g]
    fused = tr.compute_logprobs(flat)
    tr.fused_logprobs = False
    plain = tr.compute_logprobs(flat)
    tol = 1e-4 if dtype == "float32" else 5e-2
    for a, b in zip(fused, plain):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=tol)


def test_float32_trainer_matches_model_forward() -> None:
    tr = _trainer("float32")
    t = make_traj("a", 0, [5, 6, 7], [30, 31, 32, 33])
    (lp,) = tr.compute_logprobs([t])
    with torch.no_grad():
        logits = tr.model(torch.tensor([t.prompt_tokens + t.response_tokens], device="cuda")).logits[0, 2:-1]
    ref = token_logprobs(logits, torch.tensor(t.response_tokens, device="cuda")).cpu()
    assert torch.allclose(torch.tensor(lp), ref, atol=1e-4)


def test_compiled_layers_train() -> None:
    tr = _trainer(compile=True)
    groups = random_groups()
    set_behaviour(tr, groups)
    m = tr.train_step(groups)
    assert m["train/optimizer_steps"] == 1.0 and all(v == v for v in m.values())




def test_background_warmup_switches_to_cached_compiled_layers(tmp_path, monkeypatch) -> None:
    """--compile-warmup background on CUDA: the child process compiles the layers' graphs
    into fresh caches while the trainer steps eagerly; once it is done the trainer's own
    compile finds them there (no FX graph cache miss), and the compiled step trains as an
    eager twin does."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    torch._dynamo.reset()
    counters.clear()
    tr = _trainer("float32", compile=True, compile_warmup="background", max_tokens_per_micro_batch=256)
    twin = _trainer("float32", compile=False, max_tokens_per_micro_batch=256)
    assert not tr.compiled and tr._background is not None
    groups = random_groups()
    set_behaviour(twin, groups)
    assert tr.train_step(groups)["perf/compiled"] == 0.0  # the child is still importing torch
    twin.train_step(groups)
    tr._background.proc.wait(timeout=240)
    assert tr._background.proc.returncode == 0, tr._background.log_path.read_text()[-2000:]
    tr.model.load_state_dict(twin.model.state_dict())
    groups = random_groups(seed=1)
    set_behaviour(twin, groups)
    a, b = twin.train_step(groups), tr.train_step(groups)
    assert b["perf/compiled"] == 1.0 and b["perf/compiled_from_step"] == 2.0
    for key in ("train/loss", "train/grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-4), key
    assert counters["inductor"]["fxgraph_cache_hit"] > 0  # the child's graphs, read back
