"""Policy trainers (``miles.protocols.TrainerBackend``).

- ``step``: ``RLStep``, the train step both trainers share (reference log-probs, advantages,
  proximal recompute, mini-batches, loss, metrics), with hooks for a backend's forward /
  backward and optimizer step. Rows whose advantages are all 0 (a GRPO group of one reward)
  carry no gradient: the eager embedded trainer gives them no forward (``zero_advantage_rows``;
  "forward" runs them without autograd, for their metrics).
- ``embedded``: ``EmbeddedTrainer`` — pure PyTorch on CPU or GPU (FSDP2 across GPUs).
- ``config``: ``TrainerConfig`` (optimizer, LR schedule, batching, precision flags).
- ``batching``: trajectories → padded token tensors; micro-batch planning.
- ``logprobs``: response-token log-probs with a memory-lean fused LM head + log-softmax
  (on the CPU, a forward over the real tokens only, a shared prompt once: ``unpads``).
- ``parallel``: a CPU trainer's micro-batches side by side on idle cores.
- ``state``: weight export and checkpoint state (tensors + plain values, no pickle).
- ``metrics``: folds micro-batch metrics into one dict per step.
- ``fsdp``: the FSDP2 wrapping (tested on two CPU ranks over gloo; not yet on GPUs).

A Megatron-core trainer for large MoE models (``megatron/``) is the other ``RLStep`` backend.
"""

from miles.trainers.config import TrainerConfig, TrainerConfigError, lr_at
from miles.trainers.embedded import EmbeddedTrainer
from miles.trainers.step import NonFiniteError, RLStep

__all__ = ["EmbeddedTrainer", "NonFiniteError", "RLStep", "TrainerConfig", "TrainerConfigError", "lr_at"]
