"""SpeculativeConfig: the ``speculative`` config section (engine side and DraftTrainer side).

Field names are the CLI flags with '-' → '_'. How slime's SGLang flags map onto these
(``sglang_args`` / ``from_sglang_args`` do it in code, for the SGLang backend):

| slime / SGLang                                  | miles                                   |
|-------------------------------------------------|-----------------------------------------|
| ``--sglang-speculative-algorithm EAGLE/EAGLE3/NEXTN`` | ``--speculative-algorithm eagle``   |
| ``--sglang-speculative-algorithm STANDALONE``   | ``--speculative-algorithm draft``       |
| ``--sglang-speculative-num-steps N``            | ``--speculative-num-steps N`` (k)       |
| ``--sglang-speculative-eagle-topk 1``           | (chain drafts only: topk is always 1)   |
| ``--sglang-speculative-num-draft-tokens N+1``   | ``--speculative-num-draft-tokens N+1``  |
| ``--sglang-speculative-draft-model-path P``     | ``--draft-model-path P``                |

miles' own additions: ``--speculative-sampling``, ``--speculative-adaptive``,
``--speculative-max-batch-size``, and the DraftTrainer's ``--enable-draft-training``,
``--draft-lr``, ``--draft-train-interval`` (publish a draft version every N trained policy
batches) and friends.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

MAX_STEPS = 16  # longest chain a round drafts (the cache headroom and buffers are sized by it)
_SGLANG_ALGOS = {"eagle": "EAGLE", "draft": "STANDALONE"}
_FROM_SGLANG = {"EAGLE": "eagle", "EAGLE3": "eagle", "NEXTN": "eagle", "MTP": "eagle", "STANDALONE": "draft"}


class SpeculativeConfig(msgspec.Struct, kw_only=True):
    # none: plain decoding; draft: a small independent LM; eagle: a head on the policy's
    # hidden states (miles.models.draft).
    speculative_algorithm: Literal["none", "draft", "eagle"] = "none"
    # k: draft tokens proposed per round (the most, when --speculative-adaptive picks k).
    speculative_num_steps: int = 3
    # SGLang's name: tokens the policy verifies per round. Chain drafts verify k + 1
    # (None = that); tree drafts (eagle-topk > 1) are not implemented.
    speculative_num_draft_tokens: int | None = None
    # rejection: standard speculative sampling; coupled: draft and policy share the plain
    # sampler's seeded noise, so tokens equal non-speculative decoding exactly (see
    # miles.engines.spec.sampling).
    speculative_sampling: Literal["rejection", "coupled"] = "rejection"
    # Measure plain steps and rounds per batch size and pick plain decoding or the k with
    # the best tokens/s (miles.engines.spec.controller); False: always speculate with k.
    speculative_adaptive: bool = True
    # Never speculate with more requests decoding at once (0 = no cap): large batches are
    # compute-bound and verify k + 1 tokens per row at (k + 1)× the cost.
    speculative_max_batch_size: int = 0
    # Steps between re-measurements of the options the adaptive rule is not using.
    speculative_probe_interval: int = 64
    # The draft's HF-style checkpoint (config.json + safetensors); None: a fresh draft of
    # --draft-num-hidden-layers / --draft-hidden-size, initialised from --seed.
    draft_model_path: str | None = None
    draft_num_hidden_layers: int = 1
    draft_hidden_size: int = 0  # the independent LM's width (0: a quarter of the policy's)
    # ---- DraftTrainer ------------------------------------------------------------------
    enable_draft_training: bool = False  # train the draft online on fresh rollouts (the DraftTrainer)
    draft_lr: float = 1e-4  # the DraftTrainer's learning rate
    draft_train_interval: int = 1  # publish a draft version every N trained policy batches
    draft_kl_coef: float = 0.0  # + KL(policy ‖ draft) on the policy copy's full distribution
    draft_micro_batch_size: int = 16  # trajectories per draft optimizer step
    draft_max_queue: int = 4096  # trajectories waiting to be trained on; older ones are dropped

    def __post_init__(self) -> None:
        k = self.speculative_num_steps
        if not 1 <= k <= MAX_STEPS:
            raise ValueError(f"--speculative-num-steps must be in [1, {MAX_STEPS}], got {k}")
        n = self.speculative_num_draft_tokens
        if n is not None and n != k + 1:
            raise ValueError(f"--speculative-num-draft-tokens {n}: chain drafts verify "
                             f"--speculative-num-steps + 1 = {k + 1} tokens (tree drafts are not implemented)")
        for name in ("speculative_max_batch_size", "draft_hidden_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        for name in ("speculative_probe_interval", "draft_num_hidden_layers", "draft_train_interval",
                     "draft_micro_batch_size", "draft_max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if not self.draft_lr >= 0 or not self.draft_kl_coef >= 0:
            raise ValueError("--draft-lr and --draft-kl-coef must be >= 0")
        if self.enable_draft_training and self.speculative_algorithm == "none":
            raise ValueError("--enable-draft-training needs --speculative-algorithm draft or eagle")

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm != "none"


def sglang_args(cfg: SpeculativeConfig) -> dict[str, Any]:
    """SGLang server flags (without the leading ``--``) for these settings."""
    if not cfg.enabled:
        return {}
    out: dict[str, Any] = {
        "speculative-algorithm": _SGLANG_ALGOS[cfg.speculative_algorithm],
        "speculative-num-steps": cfg.speculative_num_steps,
        "speculative-eagle-topk": 1,
        "speculative-num-draft-tokens": cfg.speculative_num_draft_tokens or cfg.speculative_num_steps + 1,
    }
    if cfg.draft_model_path:
        out["speculative-draft-model-path"] = cfg.draft_model_path
    return out


def from_sglang_args(args: dict[str, Any]) -> dict[str, Any]:
    """miles flag values (field names) for slime-style ``--sglang-speculative-*`` flags."""
    out: dict[str, Any] = {}
    algo = args.get("speculative-algorithm")
    if algo is not None:
        if str(algo).upper() not in _FROM_SGLANG:
            raise ValueError(f"--sglang-speculative-algorithm {algo}: not one of {sorted(_FROM_SGLANG)}")
        out["speculative_algorithm"] = _FROM_SGLANG[str(algo).upper()]
    if int(args.get("speculative-eagle-topk", 1)) != 1:
        raise ValueError("--sglang-speculative-eagle-topk > 1 (tree drafts) is not implemented by the embedded engine")
    for key, name in (("speculative-num-steps", "speculative_num_steps"),
                      ("speculative-num-draft-tokens", "speculative_num_draft_tokens"),
                      ("speculative-draft-model-path", "draft_model_path")):
        if key in args:
            out[name] = args[key]
    return out
