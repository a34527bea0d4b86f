"""Runs that need two GPUs: the trainer and the rollout engine on GPUs of their own with
weights over NCCL (embedded and Megatron trainers), and Megatron tensor parallelism over two
Ray-launched ranks (``RayRankGroup``) against the single-process embedded trainer, and in a
whole run with the engine colocated on GPU 0.
Skipped with fewer than two GPUs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

from miles.config import resolve  # noqa: E402
from miles.driver import train  # noqa: E402
from tests.gpu.conftest import check_gpu_run  # noqa: E402
from tests.integration.conftest import run_flags  # noqa: E402


def test_disaggregated_embedded_run_over_nccl(ray_gpus, tiny_ckpt, task, tmp_path: Path) -> None:
    out = tmp_path / "embedded"
    cfg = resolve(run_flags(tiny_ckpt, task, out, device="cuda", actor_num_gpus_per_node=1, rollout_num_gpus=1,
                            weight_transport="nccl", mode="async", max_staleness=1, num_rollout=4))
    check_gpu_run(out, asyncio.run(train(cfg)), 4, "NCCL")


def test_megatron_trainer_run_over_nccl(ray_gpus, tiny_ckpt, task, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    out = tmp_path / "megatron"
    cfg = resolve(run_flags(tiny_ckpt, task, out, device="cuda", train_backend="megatron",
                            actor_num_gpus_per_node=1, rollout_num_gpus=1, weight_transport="nccl",
                            mode="async", max_staleness=1, num_rollout=4))
    check_gpu_run(out, asyncio.run(train(cfg)), 4, "NCCL")


def test_megatron_tp2_colocated_run(ray_gpus, tiny_ckpt, task, tmp_path: Path) -> None:
    """A whole RL run with a TP=2 Megatron trainer over both GPUs (one Ray actor per rank) and
    the engine colocated on GPU 0 beside rank 0; the driving actor sends over CUDA IPC."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "tp2"
    cfg = resolve(run_flags(tiny_ckpt, task, out, device="cuda", train_backend="megatron",
                            actor_num_gpus_per_node=2, tensor_model_parallel_size=2, colocate=True,
                            mode="async", max_staleness=1, partial_rollout=True, num_rollout=4))
    check_gpu_run(out, asyncio.run(train(cfg)), 4, "CUDA IPC")


def test_megatron_tp2_rank_group_equals_embedded(ray_gpus, tmp_path: Path) -> None:
    """Two Ray actors, one GPU each, one TP=2 Megatron model: float32 log-probs, one RL step's
    loss and the exported weights agree with the embedded trainer on one GPU."""
    pytest.importorskip("megatron.core")
    from miles.models import CausalLM, load_pretrained, save_pretrained, tiny_config
    from miles.trainers import EmbeddedTrainer
    from miles.trainers.megatron import build_megatron_trainer
    from tests.unit.trainers.conftest import random_groups, set_behaviour

    torch.manual_seed(0)
    save_pretrained(CausalLM(tiny_config(initializer_range=0.1)), tmp_path)
    cfg = resolve({"hf_checkpoint": str(tmp_path), "train_backend": "megatron", "actor_num_gpus_per_node": 2,
                   "tensor_model_parallel_size": 2, "device": "cuda", "dtype": "float32", "lr": 1e-3, "micro_batch_size": 3,
                   "use_tis": True}, check=False)
    group = build_megatron_trainer(cfg)
    assert type(group).__name__ == "RayRankGroup"
    torch.backends.cuda.matmul.allow_tf32 = False
    embedded = EmbeddedTrainer(load_pretrained(tmp_path, dtype=torch.float32, device="cuda"),
                               config=msgspec.structs.replace(cfg.trainer, fsdp=False, seed=cfg.run.seed),
                               algo=cfg.algorithm)
    groups = random_groups()
    flat = [t for g in groups for t in g]
    a, b = group.compute_logprobs(flat), embedded.compute_logprobs(flat)
    worst = max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))
    print(f"\nTP=2 vs embedded: max |Δlogp| {worst:.2e}")
    assert worst < 1e-3  # TF32 is the ranks' default; the reduction order differs across TP
    set_behaviour(embedded, groups, shift=-0.05)
    m1, m2 = group.train_step(groups), embedded.train_step(groups)
    assert abs(m1["train/loss"] - m2["train/loss"]) < 1e-2
    exported = {n: t for bucket in group.export_weights(1 << 26) for n, t in bucket}
    mine = {n: t for bucket in embedded.export_weights(1 << 26) for n, t in bucket}
    assert exported.keys() == mine.keys()
    drift = max((exported[n].float().cpu() - mine[n].float().cpu()).abs().max().item() for n in mine)
    print(f"weights after one step: max |Δ| {drift:.2e}")
    assert drift < 1e-2

