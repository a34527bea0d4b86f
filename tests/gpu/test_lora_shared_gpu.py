"""A colocated LoRA engine over the trainer's base on CUDA (``miles.engines.shared``): in one
process its parameters are the trainer's tensors and its unmerged adapters (CUDA graphs, the
Triton decode attention and its fused paths) give the merging engine's tokens and log-probs;
across processes it serves the base through CUDA IPC views, allocating no copy of it, and sees
the trainer's bytes (a change the trainer makes in place shows up in its logits)."""

from __future__ import annotations

import asyncio
import copy
import multiprocessing as mp
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.algorithms import AlgorithmConfig  # noqa: E402
from miles.engines import EmbeddedEngine, EngineConfig  # noqa: E402
from miles.engines.shared import engine_model, export_handles, open_handles  # noqa: E402
from miles.models import CausalLM, tiny_config  # noqa: E402
from miles.trainers import EmbeddedTrainer, TrainerConfig  # noqa: E402
from miles.types import GenerateRequest, SamplingParams, Trajectory  # noqa: E402

TIMEOUT = 120
IDS = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]]


def _model() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(tiny_config(initializer_range=0.1))


def _trainer(model: CausalLM, dtype: str) -> EmbeddedTrainer:
    cfg = TrainerConfig(device="cuda", dtype=dtype, lr=0.1, lora_rank=4, lora_alpha=8.0, compile=False)
    return EmbeddedTrainer(model, config=cfg, algo=AlgorithmConfig())


async def _generate(engine: EmbeddedEngine, step: int) -> list:
    reqs = [GenerateRequest(rid=f"s{step}r{i}", input_ids=[5 + i % 3, 6, 7],
                            sampling=SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True,
                                                    seed=100 * step + i)) for i in range(12)]
    return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))


def _groups(outs: list, step: int) -> list[list[Trajectory]]:
    groups: list[list[Trajectory]] = [[], [], []]
    for i, out in enumerate(outs):
        t = Trajectory(id=f"s{step}i{i}", prompt_id=f"p{i % 3}", group_id=f"s{step}g{i % 3}",
                       prompt_tokens=[5 + i % 3, 6, 7])
        t.append(out.output_ids, out.logprobs, out.versions)
        t.reward = sum(tok < 100 for tok in out.output_ids) / len(out.output_ids)
        groups[i % 3].append(t)
    return groups


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", None)])
def test_shared_engine_matches_the_merged_engine_on_cuda(dtype: str, tol: float | None) -> None:
    model = _model()
    trainer = _trainer(copy.deepcopy(model), dtype)
    cfg = EngineConfig(device="cuda", dtype=dtype, max_batch_size=16, max_seq_len=64, compile=False)
    shared = EmbeddedEngine.over_shared_base(model.config, trainer.shared_base(), config=cfg)
    merged = EmbeddedEngine(model, config=cfg)
    base = trainer.shared_base()
    eparams = shared.model.state_dict(keep_vars=True)
    matrices = [n for n, t in base.items() if t.ndim == 2 and n != "model.embed_tokens.weight"]
    assert matrices and all(eparams[n].data_ptr() == base[n].data_ptr() for n in matrices)
    ids = torch.tensor(IDS, device="cuda")
    worst: list[float] = []

    async def go() -> None:
        for step in range(3):
            a, b = await _generate(shared, step), await _generate(merged, step)
            if tol is not None:
                assert [o.output_ids for o in a] == [o.output_ids for o in b]
                worst.append(max(abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs)))
                with torch.no_grad():
                    torch.testing.assert_close(shared.model(ids).logits, merged.model(ids).logits, atol=tol, rtol=0)
            # the shared engine's recorded log-probs against the trainer's recomputation
            flat = [t for g in _groups(a, step) for t in g]
            got = trainer.compute_logprobs(flat)
            gap = max((torch.tensor(x) - torch.tensor(t.logprobs)).abs().max().item() for x, t in zip(got, flat))
            print(f"{dtype} step {step}: max |engine - trainer| log-prob {gap:.2e}")
            assert gap < (10 * tol if tol is not None else 0.5), gap
            trainer.train_step(_groups(a, step))
            shipped = [item for bucket in trainer.export_weights(1 << 20) for item in bucket]
            assert all(".lora_A." in n or ".lora_B." in n for n, _ in shipped)
            await shared.update_weights(shipped, trainer.version)
            await merged.update_weights(shipped, trainer.version)
        assert shared.stats()["engine/graph_captures"] > 0
        await shared.close()
        await merged.close()

    asyncio.run(go())
    print(f"{dtype}: max |shared - merged| log-prob per step {worst}")
    if tol is not None:
        assert max(worst) < tol, worst


def _ipc_engine(inbox: Any, outbox: Any) -> None:
    """The engine process: open the trainer's base once, then answer logits requests."""
    try:
        shared = inbox.get()
        torch.cuda.init()
        before = torch.cuda.memory_allocated()
        base = open_handles(shared, torch.cuda.current_device())
        config = tiny_config(initializer_range=0.1)
        model, names = engine_model(config, base, "cuda", torch.float32)
        allocated = torch.cuda.memory_allocated() - before  # mapped views are not allocations
        ecfg = EngineConfig(device="cuda", dtype="float32", max_seq_len=64, compile=False)
        engine = EmbeddedEngine(model, config=ecfg, shared=names)
        outbox.put((allocated, len(engine.shared)))
        while inbox.get() is not None:
            with torch.no_grad():
                outbox.put(engine.model(torch.tensor(IDS, device="cuda")).logits.cpu())
    except Exception as exc:
        outbox.put(exc)


def test_engine_in_another_process_serves_the_base_through_ipc_views() -> None:
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_engine, args=(inbox, outbox), daemon=True)
    proc.start()
    trainer = _trainer(_model(), "float32")
    base = trainer.shared_base()
    base_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in base.values()}.values())
    local = EmbeddedEngine.over_shared_base(trainer.model.config, base,
                                            config=EngineConfig(device="cuda", dtype="float32", max_seq_len=64, compile=False))
    try:
        inbox.put(export_handles(base))
        got = outbox.get(timeout=TIMEOUT)
        assert not isinstance(got, Exception), got
        allocated, n_shared = got
        assert n_shared == len(local.shared)
        print(f"engine process allocated {allocated} B beside a base of {base_bytes} B")
        assert allocated < base_bytes / 10  # views of the trainer's memory, no copy
        ids = torch.tensor(IDS, device="cuda")
        for change in (0.0, 0.5):
            with torch.no_grad():
                trainer.model.model.layers[0].mlp.down_proj.weight.add_(change)  # in place, as frozen bytes
                want = local.model(ids).logits.cpu()
            torch.cuda.synchronize()
            inbox.put(True)
            got = outbox.get(timeout=TIMEOUT)
            assert not isinstance(got, Exception), got
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # the other process sees the change
    finally:
        inbox.put(None)
        proc.join(timeout=TIMEOUT)
