"""Policy-gradient algorithms as pure tensor functions.

- ``config``: ``AlgorithmConfig``, the flags (``--advantage-estimator``, ``--eps-clip``, ...).
- ``advantages``: ``compute_advantages`` (GRPO, Dr. GRPO, RLOO, REINFORCE++, PPO/GAE; GSPO
  uses GRPO's advantages).
- ``corrections``: ``importance_weights`` (TIS / MIS / IcePop, token / sequence / geometric,
  veto) and ``loglinear_prox_logp`` (AReaL's proximal-policy approximation).
- ``losses``: PPO clip (asymmetric, dual-clip), GSPO ratio, KL and entropy terms, loss
  aggregation, and ``compute_loss`` — what a trainer calls per micro-batch.

Trainers (``miles.trainers``) build the tensors; nothing here knows about models or actors.
"""

from miles.algorithms.advantages import compute_advantages
from miles.algorithms.config import AlgorithmConfig, AlgorithmConfigError
from miles.algorithms.corrections import (
    importance_weights,
    importance_weights_with_stats,
    loglinear_prox_logp,
)
from miles.algorithms.losses import (
    LossDenominators,
    PolicyBatch,
    agg_loss,
    compute_loss,
    entropy_from_logits,
    kl_estimate,
    ppo_clip_loss,
    sequence_log_ratio,
)

policy_loss = compute_loss

__all__ = [
    "AlgorithmConfig",
    "AlgorithmConfigError",
    "LossDenominators",
    "PolicyBatch",
    "agg_loss",
    "compute_advantages",
    "compute_loss",
    "entropy_from_logits",
    "importance_weights",
    "importance_weights_with_stats",
    "kl_estimate",
    "loglinear_prox_logp",
    "policy_loss",
    "ppo_clip_loss",
    "sequence_log_ratio",
]
