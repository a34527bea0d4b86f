"""Building the Megatron trainer from a run's config, on one GPU or on a group of Ray-launched ranks.

``build_megatron_trainer(cfg)`` is what ``miles.actors.factory.build_policy_trainer`` calls for
``--train-backend megatron``. The world size is ``--actor-num-nodes × --actor-num-gpus-per-node``:

- 1 (or a process already started by ``torchrun``, which sets ``WORLD_SIZE``): a
  ``MegatronTrainer`` in this process;
- more: a ``RayRankGroup`` — one Ray actor per GPU, each one Megatron rank running the same
  calls (SPMD), with rank 0's answers returned. It satisfies ``TrainerBackend``, so the
  PolicyTrainer actor drives it like any backend. In a run, rank r sits on bundle r of the
  run's placement group; the PolicyTrainer actor shares rank 0's GPU (``first_gpu_share``),
  and so do the rollout workers with ``--colocate``. ``tests/gpu/test_multi_gpu.py`` runs TP=2
  on two GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import torch

from miles.algorithms import AlgorithmConfig
from miles.trainers.config import TrainerConfig
from miles.trainers.megatron.config import MegatronConfig
from miles.types import Trajectory


def megatron_section(cfg: Any) -> MegatronConfig:
    """The run's ``megatron`` section, or the defaults when the config has none."""
    try:
        section = cfg.section("megatron")
    except (KeyError, AttributeError):
        section = None
    return section if isinstance(section, MegatronConfig) else MegatronConfig()


def build_megatron_trainer(cfg: Any) -> Any:
    """A ``TrainerBackend`` for the run's config (``cfg.rollout.hf_checkpoint`` is required)."""
    from miles.trainers.megatron.trainer import MegatronTrainer

    path = cfg.rollout.hf_checkpoint
    if not path:
        raise ValueError("--train-backend megatron needs --hf-checkpoint (a local HF checkpoint directory)")
    # The backend is CUDA-only; ``--device`` is shared with the engine section, so a CPU engine
    # next to a Megatron trainer leaves it at "cpu".
    device = cfg.trainer.device if cfg.trainer.device.startswith("cuda") else "cuda"
    trainer_cfg = msgspec.structs.replace(cfg.trainer, seed=cfg.run.seed, device=device)
    mcfg = megatron_section(cfg)
    world = max(1, cfg.run.actor_num_nodes) * max(1, cfg.run.actor_num_gpus_per_node)
    if world > 1 and "WORLD_SIZE" not in os.environ:
        return RayRankGroup(world, str(path), trainer_cfg, cfg.algorithm, mcfg,
                            rank0_gpus=first_gpu_share(cfg.run.colocate, cfg.run.num_rollout_workers))
    return MegatronTrainer.from_pretrained(path, config=trainer_cfg, algo=cfg.algorithm, megatron=mcfg)


def first_gpu_share(colocate: bool, num_rollout_workers: int) -> float:
    """The share of the run's first GPU that rank 0 takes, and so does the PolicyTrainer actor
    driving the ranks: that actor sends the weights (its NCCL or CUDA IPC sender needs a
    device), and with ``--colocate`` every rollout worker takes one more share of that GPU
    (CUDA IPC maps the driver's buffers there)."""
    return 1.0 / (2 + num_rollout_workers) if colocate else 0.5


class _Rank:
    """One Megatron rank inside a Ray actor (Ray gives it one GPU as cuda:0)."""

    def address(self) -> tuple[str, int]:
        import ray

        from miles.utils.net import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, env: dict[str, str], path: str, config: TrainerConfig, algo: AlgorithmConfig,
              megatron: MegatronConfig) -> int:
        from miles.trainers.megatron.trainer import MegatronTrainer

        os.environ.update(env)
        self.rank = int(env["RANK"])
        self.trainer = MegatronTrainer.from_pretrained(path, config=config, algo=algo, megatron=megatron)
        return self.trainer.version

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
        return self.trainer.train_step(groups)

    def compute_logprobs(self, trajs: Sequence[Trajectory]) -> list[list[float]]:
        return self.trainer.compute_logprobs(trajs)

    def export(self, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
        buckets = []
        for bucket in self.trainer.export_weights(bucket_bytes):  # collective: run it out on every rank
            if self.rank == 0:
                buckets.append([(n, t.cpu()) for n, t in bucket])
        return buckets

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)


class RayRankGroup:
    """``world`` Megatron ranks as Ray actors with one GPU each, driven as one TrainerBackend."""

    def __init__(self, world: int, path: str, config: TrainerConfig, algo: AlgorithmConfig,
                 megatron: MegatronConfig, *, rank0_gpus: float = 1.0) -> None:
        import ray

        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = ray.remote(_Rank)
        pg = ray.util.get_current_placement_group()  # the run's: bundles 0..world-1 are the trainer's
        self.ranks = [
            actor.options(num_gpus=rank0_gpus if r == 0 else 1, num_cpus=0.1, scheduling_strategy=(
                PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=r)
                if pg is not None else None)).remote()
            for r in range(world)
        ]
        addr, port = ray.get(self.ranks[0].address.remote())
        envs = [{"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": addr,
                 "MASTER_PORT": str(port)} for r in range(world)]
        # every rank joins the process group inside setup, so the calls must run concurrently
        versions = ray.get([a.setup.remote(env, path, config, algo, megatron) for a, env in zip(self.ranks, envs)])
        self._version = versions[0]

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(a, method).remote(*args) for a in self.ranks])

    @property
    def version(self) -> int:
        return self._version

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
        metrics = self._all("train_step", [list(g) for g in groups])[0]
        self._version = int(metrics["train/version"])
        return metrics

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        return self._all("compute_logprobs", list(trajectories))[0]

    def export_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        yield from self._all("export", bucket_bytes)[0]

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": self._all("state_dict")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import ray

        ranks = state.get("ranks")
        if not isinstance(ranks, list) or len(ranks) != len(self.ranks):
            raise ValueError(f"trainer state has {len(ranks) if isinstance(ranks, list) else 'no'} rank "
                             f"states; this group has {len(self.ranks)} ranks")
        ray.get([a.load_state_dict.remote(s) for a, s in zip(self.ranks, ranks)])
        self._version = int(ranks[0]["trainer"]["version"])
