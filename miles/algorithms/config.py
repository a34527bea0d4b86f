"""``AlgorithmConfig``: the flags that choose the advantage estimator, the policy loss and
the off-policy corrections.

Field names are the CLI flag names with '-' → '_' (``--eps-clip-high`` ↔ ``eps_clip_high``).
Defaults follow slime where slime has the flag (eps_clip 0.2, tis_clip 2.0, gamma/lam 1.0,
kl type k1, entropy 0, GRPO estimator, per-sequence mean aggregation). The config layer
builds it with ``msgspec.convert(mapping, AlgorithmConfig)``; constructing it directly runs
the same validation (``__post_init__``), and every error names the offending field.

How the knobs compose (see ``losses.compute_loss`` for the exact formula):

- the PPO ratio is π_θ / π_prox, where π_prox (the policy before this update) is recomputed
  with the pre-update weights (``prox_logp="recompute"``) or approximated from per-token
  versions (``"loglinear"``, AReaL);
- every loss token is weighted by a behaviour correction w ≈ π_prox / π_behav:
  ``use_tis`` → truncated (``tis_mode="truncate"``) or masked (``"mask"``) weights from
  ``importance_weights``; else ``use_decoupled_loss`` → the raw ratio (AReaL's decoupled
  PPO); else w = 1 (no correction: rollout samples are treated as if drawn from π_prox);
- ``advantage_estimator="gspo"`` uses GRPO advantages with GSPO's sequence-level,
  length-normalized ratio in the clip.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "ppo", "gspo"]
TisLevel = Literal["token", "sequence", "geometric"]
TisMode = Literal["truncate", "mask"]
ProxLogp = Literal["recompute", "loglinear"]
KlType = Literal["k1", "k2", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "grpo", "bnpo", "dapo", "dr_grpo"]
StdLevel = Literal["group", "batch"]
# TRL's ``loss_type`` names for the same aggregations (TRL's "dr_grpo" divides by the
# generation budget: set --loss-agg-max-tokens to --rollout-max-response-len for its scale).
LOSS_AGG_ALIASES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
                    "dr_grpo": "seq-mean-token-sum-norm"}

CHOICES: dict[str, tuple[str, ...]] = {
    "advantage_estimator": ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "ppo", "gspo"),
    "tis_level": ("token", "sequence", "geometric"),
    "tis_mode": ("truncate", "mask"),
    "prox_logp": ("recompute", "loglinear"),
    "kl_type": ("k1", "k2", "k3"),
    "loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "grpo_std_level": ("group", "batch"),
}


class AlgorithmConfigError(ValueError):
    """An AlgorithmConfig field has a bad value; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"AlgorithmConfig.{field}: {message}")
        self.field = field


# The correction a stale mode gets unless the user picks one: masked importance sampling
# with IcePop's bounds. benchmarks/off_policy.py found it the one correction that recovers
# η = 0's reward at η = 8 in every seed of both invocations, where truncated IS and
# decoupled PPO collapse in some seeds (benchmarks/RESULTS.md, "off_policy").
STALE_MODE_CORRECTION: dict[str, object] = {"use_tis": True, "tis_mode": "mask", "tis_clip": 5.0, "tis_clip_low": 0.5}
STALE_MODES = ("async", "one-step-off")
_CORRECTION_SWITCHES = ("use_tis", "use_decoupled_loss")


def resolve_correction(values: dict[str, object], mode: str) -> dict[str, object]:
    """Flat flag values with ``off_policy_correction`` decided (True/False) and, where it
    is on and no correction was named, ``STALE_MODE_CORRECTION``'s fields the user left
    unset. A switch the user set (either value) is their choice and is kept."""
    out = dict(values)
    chosen = any(bool(out.get(k)) for k in _CORRECTION_SWITCHES)
    want = out.get("off_policy_correction")
    if want is None:
        explicit = any(k in out for k in _CORRECTION_SWITCHES)
        want = chosen if explicit else mode in STALE_MODES
    if not want and chosen:
        raise AlgorithmConfigError("off_policy_correction",
                                   "--no-off-policy-correction contradicts --use-tis / --use-decoupled-loss")
    if want and not chosen:
        for key, value in STALE_MODE_CORRECTION.items():
            if key == "use_tis" or key not in out:
                out[key] = value
    out["off_policy_correction"] = bool(want)
    return out


class AlgorithmConfig(msgspec.Struct, kw_only=True):
    """Advantage estimator, policy loss and off-policy correction flags."""

    # --- advantages ---------------------------------------------------------------------
    advantage_estimator: AdvantageEstimator = "grpo"  # how rewards become per-token advantages
    gamma: float = 1.0  # discount (GAE, REINFORCE++ returns)
    lam: float = 1.0  # GAE lambda (slime: --lambd)
    # REINFORCE++ only: per-token KL(π_behav‖π_ref) penalty folded into the reward
    # (slime calls this --kl-coef; here --kl-coef is the KL *loss* term, as the issue asks).
    reward_kl_coef: float = 0.0
    grpo_std_eps: float = 1e-6  # GRPO's std + eps denominator (slime 1e-6; TRL 1e-4)
    grpo_std_level: StdLevel = "group"  # the std of each group (slime, TRL default) or of the whole batch (TRL "batch")
    grpo_std_unbiased: bool = True  # Bessel's correction (n - 1) in that std, as torch.std, slime and TRL

    # --- PPO clip -----------------------------------------------------------------------
    # For GSPO the clip applies to the sequence's geometric-mean ratio, which moves far less
    # than token ratios: its paper uses eps_clip=3e-4, eps_clip_high=4e-4.
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None → eps_clip (symmetric); DAPO uses 0.28
    dual_clip_c: float | None = None  # dual-clip lower bound for A < 0 (must be > 1)

    # --- rollout corrections (importance_weights) ---------------------------------------
    # Correct stale samples: None → on in --mode async and one-step-off, off in sync. On
    # with neither --use-tis nor --use-decoupled-loss set means MIS (STALE_MODE_CORRECTION).
    off_policy_correction: bool | None = None
    use_tis: bool = False  # weight the loss by truncated (TIS) or masked (MIS) importance ratios
    tis_clip: float = 2.0  # importance_weights' ``high``
    tis_clip_low: float | None = None  # ``low``; None → 0 (truncate) or 1/tis_clip (mask)
    tis_level: TisLevel = "token"  # importance ratios per token, per sequence (product), or their geometric mean
    tis_mode: TisMode = "truncate"  # truncate (TIS) or mask (MIS) ratios beyond the bounds
    tis_veto: float | None = None  # mask a sequence if any token ratio < veto

    # --- decoupled PPO ------------------------------------------------------------------
    use_decoupled_loss: bool = False  # decoupled PPO: clip against a proximal policy, correct behaviour by ratio
    prox_logp: ProxLogp = "recompute"  # the proximal log-probs: recomputed by the trainer, or interpolated

    # --- regularizers -------------------------------------------------------------------
    kl_coef: float = 0.0  # KL(π_θ‖π_ref) loss term; needs a reference model when > 0
    kl_type: KlType = "k1"  # the KL estimator of --kl-coef (k1, k2 or k3)
    entropy_coef: float = 0.0  # entropy bonus in the loss

    # --- aggregation --------------------------------------------------------------------
    # per sequence mean then batch mean (slime's default; TRL "grpo"), all loss tokens' mean
    # (slime --calculate-per-token-loss; TRL "bnpo"/"dapo"), or token sums over a constant
    # (Dr. GRPO); TRL's names are accepted and resolved to these.
    loss_agg: LossAgg = "seq-mean-token-mean"
    # Constant normalizer of "seq-mean-token-sum-norm" (Dr. GRPO uses the generation
    # budget); None → the padded response length of the batch.
    loss_agg_max_tokens: int | None = None

    def __post_init__(self) -> None:
        self.loss_agg = LOSS_AGG_ALIASES.get(self.loss_agg, self.loss_agg)  # type: ignore[assignment]
        validate(self)

    # ---- derived ---------------------------------------------------------------------
    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def importance_mode(self) -> Literal["tis", "mask"]:
        """``tis_mode`` in ``importance_weights``' vocabulary."""
        return "tis" if self.tis_mode == "truncate" else "mask"

    @property
    def sequence_ratio(self) -> bool:
        """GSPO: the clipped ratio is the sequence's length-normalized (geometric) ratio."""
        return self.advantage_estimator == "gspo"


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise AlgorithmConfigError(field, message)


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate(cfg: AlgorithmConfig) -> None:
    """Raise AlgorithmConfigError naming the first bad field."""
    for field, choices in CHOICES.items():
        value = getattr(cfg, field)
        _check(value in choices, field, f"{value!r} is not one of {list(choices)}")
    for field in ("gamma", "lam"):
        value = getattr(cfg, field)
        _check(_finite(value) and 0.0 <= value <= 1.0, field, f"must be in [0, 1], got {value!r}")
    _check(_finite(cfg.grpo_std_eps) and cfg.grpo_std_eps >= 0.0, "grpo_std_eps",
           f"must be a finite number >= 0, got {cfg.grpo_std_eps!r}")
    for field in ("reward_kl_coef", "kl_coef", "entropy_coef"):
        value = getattr(cfg, field)
        _check(_finite(value) and value >= 0.0, field, f"must be a finite number >= 0, got {value!r}")
    _check(_finite(cfg.eps_clip) and cfg.eps_clip > 0, "eps_clip", f"must be > 0, got {cfg.eps_clip!r}")
    if cfg.eps_clip_high is not None:
        _check(
            _finite(cfg.eps_clip_high) and cfg.eps_clip_high > 0,
            "eps_clip_high",
            f"must be > 0, got {cfg.eps_clip_high!r}",
        )
    if cfg.dual_clip_c is not None:
        _check(
            _finite(cfg.dual_clip_c) and cfg.dual_clip_c > 1.0,
            "dual_clip_c",
            f"must be > 1 (dual-clip lower bound), got {cfg.dual_clip_c!r}",
        )
    _check(_finite(cfg.tis_clip) and cfg.tis_clip > 0, "tis_clip", f"must be > 0, got {cfg.tis_clip!r}")
    if cfg.tis_clip_low is not None:
        _check(
            _finite(cfg.tis_clip_low) and 0.0 <= cfg.tis_clip_low <= cfg.tis_clip,
            "tis_clip_low",
            f"must be in [0, tis_clip={cfg.tis_clip}], got {cfg.tis_clip_low!r}",
        )
    if cfg.tis_veto is not None:
        _check(_finite(cfg.tis_veto) and cfg.tis_veto > 0, "tis_veto", f"must be > 0, got {cfg.tis_veto!r}")
    if cfg.loss_agg_max_tokens is not None:
        _check(
            isinstance(cfg.loss_agg_max_tokens, int) and cfg.loss_agg_max_tokens > 0,
            "loss_agg_max_tokens",
            f"must be a positive int, got {cfg.loss_agg_max_tokens!r}",
        )
