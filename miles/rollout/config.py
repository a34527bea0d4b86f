"""RolloutConfig: what rollout workers generate and how rewards are computed."""

from __future__ import annotations

import msgspec


class RolloutConfig(msgspec.Struct, kw_only=True):
    """What rollout workers generate and how rewards are computed."""

    hf_checkpoint: str | None = None  # local Hugging Face checkpoint dir: config.json, *.safetensors, tokenizer.json
    n_samples_per_prompt: int = 4  # samples per prompt: one group
    rollout_max_response_len: int = 128  # most tokens a response may have
    rollout_temperature: float = 1.0  # sampling temperature (0: greedy)
    rollout_top_p: float = 1.0  # nucleus sampling
    rollout_top_k: int = -1  # top-k sampling (-1: off)
    rollout_stop: list[str] = []  # stop strings
    rollout_stop_token_ids: list[int] = []  # stop token ids (besides the tokenizer's eos)
    partial_rollout: bool = False  # weight updates land between decode steps; unfinished work continues
    max_inflight_per_worker: int = 64  # trajectories a worker generates at once
    custom_rm_path: str | None = None  # reward function: pkg.mod:fn, pkg.mod.fn or path/file.py:fn
    custom_generate_function_path: str | None = None  # replaces single-turn generation (tools, agents)
    reward_key: str | None = None  # which entry of a dict reward to train on (None: the sum)
    reward_timeout_s: float = 30.0  # a reward call that takes longer fails its sample
    dynamic_sampling_filter_path: str | None = None  # fn(group) -> keep? (e.g. miles.buffers:drop_uniform_rewards)
