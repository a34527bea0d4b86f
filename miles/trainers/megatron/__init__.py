"""The Megatron-core trainer backend (``--train-backend megatron``; ``pip install miles[megatron]``).

Same ``TrainerBackend`` surface and arithmetic as ``miles.trainers.EmbeddedTrainer``; the model,
tensor / pipeline / expert / context / data parallelism, optimizer and micro-batch schedule are
megatron-core's. Importing this package needs no megatron-core; building a trainer does, and
says which extra to install when it is missing.

- ``config``       MegatronConfig: parallel sizes, layer implementation, recompute, MoE flags
- ``mapping``      HF config → TransformerConfig / GPTModel arguments (pure)
- ``convert``      HF ↔ Megatron tensor layouts and names: fused QKV, fused gate/up, vocab, experts (pure)
- ``distributed``  torch.distributed + Megatron parallel state; ``Layout`` of this rank
- ``model``        GPTModel from the layer spec (local or Transformer Engine; SDPA core attention)
- ``weights``      load HF safetensors into this rank's shards; export full HF tensors (collective)
- ``sequence``     micro-batches in Megatron's sequence layout; response log-probs (vocab-parallel)
- ``replay``       rollout routing replay through megatron-core's RouterReplay hook
- ``trainer``      MegatronTrainer
- ``state``        checkpoint state per rank (tensors + plain values)
- ``launch``       ``build_megatron_trainer(cfg)``; RayRankGroup for several GPUs
"""

from __future__ import annotations

from typing import Any

from miles.trainers.megatron.config import MegatronConfig, MegatronConfigError

__all__ = ["MegatronConfig", "MegatronConfigError", "MegatronTrainer", "build_megatron_trainer"]


def __getattr__(name: str) -> Any:
    if name == "MegatronTrainer":
        from miles.trainers.megatron.trainer import MegatronTrainer

        return MegatronTrainer
    if name == "build_megatron_trainer":
        from miles.trainers.megatron.launch import build_megatron_trainer

        return build_megatron_trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
