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

    output_dir: str = "outputs/run"  # metrics.jsonl, summary.json, dumps, config.yaml go here
    # backends: the embedded torch ones run anywhere; megatron / sglang are optional extras
    train_backend: Literal["embedded", "megatron"] = "embedded"  # the trainer: torch (anywhere) or Megatron-core
    rollout_backend: Literal["embedded", "sglang"] = "embedded"  # the engines: torch (anywhere) or SGLang servers
    num_rollout: int = 10  # trainer steps (slime: --num-rollout)
    seed: int = 1234  # seeds sampling, data order and initialisation
    deterministic: bool = False  # batch-invariant steps and fixed orders: a resumed run repeats exactly
    true_on_policy: bool = False  # batch-invariant engine and trainer (CPU float32): rollout log-probs bitwise the trainer's
    # placement (GPUs; 0 means CPU)
    actor_num_nodes: int = 1  # nodes of trainer ranks (Megatron)
    actor_num_gpus_per_node: int = 0  # the trainer's GPUs per node (0: CPU)
    rollout_num_gpus: int = 0  # GPUs of the rollout engines, apart from the trainer's (one worker each)
    rollout_num_gpus_per_engine: int = 1  # GPUs per engine (SGLang tensor parallelism)
    num_rollout_workers: int = 1  # rollout workers (one engine each); on the CPU, processes
    num_reward_workers: int = 0  # 0: rewards run inside the rollout workers
    colocate: bool = False  # the engines share the trainer's first GPU (weights by CUDA IPC)
    ray_address: str | None = None  # join this Ray cluster instead of starting a local one
    ray_num_cpus: int | None = None  # CPUs of the local Ray cluster (default: the machine's)
    # checkpoints
    save: str | None = None  # checkpoint directory (trainer, buffer with partial trajectories, data cursor)
    save_interval: int = 0  # also save every N steps (a run saves at its end and on Ctrl-C anyway)
    keep_checkpoints: int = 3  # newest checkpoints kept under --save
    load: str | None = None  # resume from a --save directory (its newest checkpoint) or one checkpoint
    save_hf: str | None = None  # at the end, write the policy as a Hugging Face checkpoint dir
    # outputs and debugging
    dump_trajectories: bool = False  # every trained trajectory to trajectories.jsonl (miles inspect reads it)
    save_debug_rollout_data: str | None = None  # record every trained batch here (slime's debug mode)
    load_debug_rollout_data: str | None = None  # train on recorded batches only: no rollouts
    eval_interval: int = 0  # evaluate --eval-prompt-data every N steps (and before step 1)
    tensorboard: bool = False  # also write TensorBoard events to OUTPUT_DIR/tb
    progress: bool = True  # a progress bar on the terminal
    update_weight_buffer_size: int = 512 * 1024 * 1024  # bytes per weight bucket
    health_check_interval_s: float = 1.0  # how often actors are pinged (and workers report stats)
    max_worker_restarts: int = 3  # replacements of a dead rollout worker before the run stops
    # Stop the run when this many groups in a row were dropped because a member FAILED
    # (a reward function or environment that always fails would otherwise spin forever);
    # 0 never stops.
    max_failed_groups_in_a_row: int = 200


class DataConfig(msgspec.Struct, kw_only=True):
    """Prompt data in JSONL (slime's format): one object per line with input/label keys."""

    prompt_data: str | None = None  # training prompts, JSONL
    input_key: str = "input"  # the prompt's key in each JSONL object
    label_key: str | None = "label"  # the label's key (handed to the reward as sample.label)
    metadata_key: str | None = "metadata"  # free metadata's key (sample.metadata)
    apply_chat_template: bool = False  # the input is a list of chat messages: render it with the tokenizer's template
    # Special tokens around a prompt (None: as transformers encodes by default — raw text
    # through the tokenizer's post-processor, BOS where it adds one; a chat template as rendered).
    add_special_tokens: bool | None = None
    rollout_shuffle: bool = False  # shuffle the prompts each epoch
    eval_prompt_data: str | None = None  # held-out prompts, JSONL (see --eval-interval)
    n_samples_per_eval_prompt: int = 1  # samples per eval prompt (pass@k up to this k)
    eval_max_prompts: int | None = None  # evaluate only the first N eval prompts
    on_bad_data: Literal["skip", "fail"] = "skip"  # a bad JSONL line: skip it (counted) or stop with its line number
    max_prompt_len: int | None = None  # longer prompts are bad lines (default: the context minus one token)


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


def _sections() -> dict[str, type[Any]]:
    # Imported here so that the registry is the one place that knows every component.
    from miles.agent.config import AgentConfig
    from miles.algorithms import AlgorithmConfig
    from miles.buffers import BufferConfig
    from miles.engines import EngineConfig
    from miles.engines.sglang import SGLangConfig
    from miles.envs.config import EnvConfig
    from miles.engines.spec import SpeculativeConfig
    from miles.models.quant import QuantConfig
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
        "agent": AgentConfig,
        "speculative": SpeculativeConfig,
        "weights": WeightsConfig,
        "quant": QuantConfig,
    }


SECTIONS: dict[str, type[Any]] = _sections()
