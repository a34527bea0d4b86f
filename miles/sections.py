"""The config sections of a run, and the runtime's own three (run, data, rollout).

Component configs live beside their components (``BufferConfig`` in ``miles.buffers`` ...);
this module only lists them in ``SECTIONS`` so that ``miles.config`` can build one flat flag
namespace over all of them. Flag names follow slime/miles where those have one.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class RunConfig(msgspec.Struct, kw_only=True):
    """Where outputs go, how long to run, placement, checkpoints, debugging."""

    output_dir: str = "outputs/run"
    # backends: the embedded torch ones run anywhere; megatron / sglang are optional extras
    train_backend: Literal["embedded", "megatron"] = "embedded"
    rollout_backend: Literal["embedded", "sglang"] = "embedded"
    num_rollout: int = 10  # trainer steps (slime: --num-rollout)
    seed: int = 1234
    deterministic: bool = False
    # placement (GPUs; 0 means CPU)
    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 0
    rollout_num_gpus: int = 0
    rollout_num_gpus_per_engine: int = 1
    num_rollout_workers: int = 1
    num_reward_workers: int = 0  # 0: rewards run inside the rollout workers
    colocate: bool = False
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    # checkpoints
    save: str | None = None
    save_interval: int = 0
    keep_checkpoints: int = 3
    load: str | None = None
    save_hf: str | None = None  # at the end, write the policy as a Hugging Face checkpoint dir
    # outputs and debugging
    dump_trajectories: bool = False
    save_debug_rollout_data: str | None = None
    load_debug_rollout_data: str | None = None
    eval_interval: int = 0
    tensorboard: bool = False
    progress: bool = True
    update_weight_buffer_size: int = 512 * 1024 * 1024  # bytes per weight bucket
    health_check_interval_s: float = 1.0
    max_worker_restarts: int = 3
    # Stop the run when this many groups in a row were dropped because a member FAILED
    # (a reward function or environment that always fails would otherwise spin forever);
    # 0 never stops.
    max_failed_groups_in_a_row: int = 200


class DataConfig(msgspec.Struct, kw_only=True):
    """Prompt data in JSONL (slime's format): one object per line with input/label keys."""

    prompt_data: str | None = None
    input_key: str = "input"
    label_key: str | None = "label"
    metadata_key: str | None = "metadata"
    apply_chat_template: bool = False
    rollout_shuffle: bool = False
    eval_prompt_data: str | None = None
    n_samples_per_eval_prompt: int = 1
    eval_max_prompts: int | None = None
    on_bad_data: Literal["skip", "fail"] = "skip"
    max_prompt_len: int | None = None


class RolloutConfig(msgspec.Struct, kw_only=True):
    """What rollout workers generate and how rewards are computed."""

    hf_checkpoint: str | None = None
    n_samples_per_prompt: int = 4
    rollout_max_response_len: int = 128
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    rollout_stop: list[str] = []
    rollout_stop_token_ids: list[int] = []
    partial_rollout: bool = False
    max_inflight_per_worker: int = 64
    custom_rm_path: str | None = None
    custom_generate_function_path: str | None = None
    reward_key: str | None = None
    reward_timeout_s: float = 30.0
    dynamic_sampling_filter_path: str | None = None


def _sections() -> dict[str, type[Any]]:
    # Imported here so that the registry is the one place that knows every component.
    from miles.algorithms import AlgorithmConfig
    from miles.buffers import BufferConfig
    from miles.engines import EngineConfig
    from miles.engines.sglang import SGLangConfig
    from miles.envs.config import EnvConfig
    from miles.engines.spec import SpeculativeConfig
    from miles.scheduler import SchedulerConfig
    from miles.trainers import TrainerConfig
    from miles.trainers.megatron.config import MegatronConfig
    from miles.transports.config import WeightsConfig

    return {
        "run": RunConfig,
        "data": DataConfig,
        "rollout": RolloutConfig,
        "scheduler": SchedulerConfig,
        "buffer": BufferConfig,
        "engine": EngineConfig,
        "trainer": TrainerConfig,
        "megatron": MegatronConfig,
        "algorithm": AlgorithmConfig,
        "sglang": SGLangConfig,
        "env": EnvConfig,
        "speculative": SpeculativeConfig,
        "weights": WeightsConfig,
    }


SECTIONS: dict[str, type[Any]] = _sections()
