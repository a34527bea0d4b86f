"""The compiled trainer's warm-up in a process of its own, so the first steps need not wait
for it (``compile_warmup="background"``, the CUDA default; ``--dev compile_warmup=...``).

Why a process: the warm-up is compile work (dynamo tracing, AOTAutograd, inductor, Triton),
tens of seconds for a Qwen3-0.6B shape, and the trainer's first step waited for all of it. Run
in a thread beside eager steps it held the GIL (the eager steps ran slower than compiled ones),
was not done after several steps, and the two threads shared one model's lazily grown buffers
(a device assert). A child process shares neither the GIL nor the model.

What carries over is torch's on-disk caches: inductor's FX graph cache, AOTAutograd's cache
and Triton's kernel cache (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``; by default per
user under /tmp and ~/.triton, so a second run finds them too). The child builds the same
decoder layer shapes with one layer (the layers share their graphs: ``compilation``), random
weights (graphs do not depend on values), a vocabulary of at most ``CHILD_VOCAB`` (so it fits
in a few GB beside a colocated engine; the two LM-head kernels, compiled for the vocabulary,
are then left to the switch), and runs the same warm-up ladder. The trainer
steps eagerly meanwhile; at the start of the first step after the child exits it compiles
its own layers and runs the warm-up again, which now hits the caches (seconds, not tens),
so the switch happens between steps, never inside one. A child that fails leaves the
trainer to compile in-process at that point, as ``compile_warmup="inline"`` does at start.

The child process itself (its spec, polling, failure report) is ``miles.utils.compile_child``,
shared with the rollout engine's compile warm-up (``miles.engines.warmup``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from miles.utils.compile_child import CHILD_VOCAB
from miles.utils.compile_child import BackgroundCompile as _Child

if TYPE_CHECKING:
    from miles.trainers.embedded import EmbeddedTrainer


def trainer_spec(trainer: EmbeddedTrainer) -> dict[str, Any]:
    """What the child needs to rebuild a trainer's compiled shapes."""
    return {"model": msgspec.to_builtins(trainer.model.config),
            "trainer": msgspec.to_builtins(trainer.config),
            "algo": msgspec.to_builtins(trainer.algo)}


class BackgroundCompile(_Child):
    """The warm-up child of one trainer: started at construction, polled between steps."""

    def __init__(self, trainer: EmbeddedTrainer) -> None:
        super().__init__(trainer_spec(trainer), entry="miles.trainers.compile_cache:warm_in_child")


def warm_in_child(spec: dict[str, Any]) -> float:
    """Build a one-layer model of the spec's shape and run the compiled trainer's warm-up;
    returns its seconds."""
    import torch

    from miles.algorithms import AlgorithmConfig
    from miles.models import CausalLM
    from miles.models.config import ModelConfig
    from miles.trainers.config import TrainerConfig
    from miles.trainers.embedded import EmbeddedTrainer

    # One layer and a small vocabulary: the decoder layers' graphs see hidden states only.
    # The full vocabulary's LM head ([tokens, vocab] logits and their gradient at the warm-up's
    # largest micro-batch, gigabytes for a 152k vocabulary) need not fit beside a colocated engine.
    vocab = min(spec["model"]["vocab_size"], CHILD_VOCAB)
    model_cfg = msgspec.convert({**spec["model"], "num_hidden_layers": 1, "vocab_size": vocab}, ModelConfig)
    trainer_cfg = msgspec.convert({**spec["trainer"], "compile": True, "compile_warmup": "inline"}, TrainerConfig)
    # the warm-up reads the entropy mode only; no reference model is built for it
    algo = msgspec.convert({**spec["algo"], "kl_coef": 0.0, "reward_kl_coef": 0.0}, AlgorithmConfig)
    with torch.device(trainer_cfg.device):
        model = CausalLM(model_cfg)
    start = time.monotonic()
    EmbeddedTrainer(model, config=trainer_cfg, algo=algo)  # compiles and warms up at construction
    return time.monotonic() - start
