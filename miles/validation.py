"""Cross-field checks on a resolved config, run once before anything starts: a run's
(``check_config``, from ``miles.config.resolve``) and ``miles serve``'s (``check_serve``).

Each problem is reported with the flag(s) at fault, and all of them at once, so that a
user fixes a bad command line in one go. Checks that need files look at the filesystem
(checkpoint and data paths) but never create anything: a run that fails here leaves no
outputs behind.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles.engines.config import DECODE_ATTENTION, KV_CACHE_DTYPES, chunk_problem
from miles.scheduler.staleness import SchedulerConfig
from miles.transports.config import transport_problems

_ESTIMATORS_NEEDING_GROUPS = {"grpo", "dr_grpo", "rloo"}
_DEFAULT_STALENESS = SchedulerConfig().max_staleness


def check_config(cfg: Any) -> None:
    from miles.config import ConfigError

    problems = list(_problems(cfg))
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def notes(cfg: Any) -> list[str]:
    """Settings that are valid but do not do what they may look like; the CLI prints them
    before the run (not errors: a YAML written for one mode, run with ``--mode`` overridden on
    the command line, is a normal way to compare modes)."""
    sched = cfg.scheduler
    out = []
    if sched.mode != "async" and sched.max_staleness != _DEFAULT_STALENESS:
        # sync trains at η = 0 and one-step-off at η = 1 whatever the flag says
        eta = 0 if sched.mode == "sync" else 1
        out.append(f"--max-staleness {sched.max_staleness} is read only with --mode async; "
                   f"--mode {sched.mode} trains at η = {eta}")
    agent = cfg.agent
    if agent.custom_agent_function_path and agent.agent_host not in ("127.0.0.1", "localhost", "::1"):
        out.append(f"--agent-host {agent.agent_host}: the agent sessions take requests from other machines; "
                   "a session's id in its URL is its only key")
    if agent.custom_agent_function_path and sched.mode == "sync" and cfg.rollout.partial_rollout:
        out.append("--mode sync --partial-rollout aborts in-flight work every step, and an agent episode "
                   "cannot be parked: those episodes fail (agent_aborted); --mode async keeps them")
    if cfg.quant.rollout_quantization != "none" and not cfg.algorithm.off_policy_correction:
        # the correction turns itself on for stale modes only; FP8 sampling is off-policy in every mode
        out.append(f"--rollout-quantization {cfg.quant.rollout_quantization} with no off-policy correction: the "
                   "engines' log-probs differ from the trainer's and nothing corrects the gap; add --use-tis "
                   "(or --off-policy-correction for MIS)")
    return out


def correction_line(cfg: Any) -> str:
    """One line naming the off-policy correction the run trains with (the driver prints it)."""
    algo, mode = cfg.algorithm, cfg.scheduler.mode
    if not algo.off_policy_correction:
        return f"--mode {mode}: no off-policy correction (samples train as if drawn from the current policy)"
    low = algo.tis_clip_low if algo.tis_clip_low is not None else (0.0 if algo.tis_mode == "truncate" else 1 / algo.tis_clip)
    kind = (f"{'MIS' if algo.tis_mode == 'mask' else 'TIS'} [{low:g}, {algo.tis_clip:g}] per {algo.tis_level}"
            if algo.use_tis else f"decoupled PPO (prox {algo.prox_logp})")
    return f"--mode {mode}: off-policy correction {kind} (--no-off-policy-correction to train uncorrected)"


def _checkpoint_problems(path: str, run: Any):
    """The checkpoint against its config.json (headers only, no weights read) where an
    embedded backend will load it; otherwise config.json alone. Checked here, a mismatch is
    one line, not a traceback from every actor that loads the weights."""
    from miles.models import CheckpointError, check_checkpoint, load_config

    embedded = run.rollout_backend == "embedded" or run.train_backend == "embedded"
    try:
        check_checkpoint(path) if embedded else load_config(path)
    except CheckpointError as exc:
        yield f"--hf-checkpoint {path}: {exc}"


def _problems(cfg: Any):  # noqa: C901 - a flat list of independent rules reads best
    run, data, rollout, sched, algo = cfg.run, cfg.data, cfg.rollout, cfg.scheduler, cfg.algorithm
    replay = bool(run.load_debug_rollout_data)
    if not rollout.hf_checkpoint:
        yield "--hf-checkpoint is required (a local directory with config.json and *.safetensors)"
    elif not (Path(rollout.hf_checkpoint) / "config.json").is_file():
        yield f"--hf-checkpoint {rollout.hf_checkpoint}: no config.json there"
    else:
        yield from _checkpoint_problems(rollout.hf_checkpoint, run)
    if not replay:
        if not data.prompt_data:
            yield "--prompt-data is required (a JSONL file)"
        elif not Path(data.prompt_data).is_file():
            yield f"--prompt-data {data.prompt_data}: file not found"
        if not (rollout.custom_rm_path or rollout.custom_generate_function_path or cfg.env.env_path
                or cfg.agent.custom_agent_function_path):
            yield ("no reward: set --custom-rm-path (or an --env-path / --custom-generate-function-path / "
                   "--custom-agent-function-path that sets rewards)")
    elif not Path(run.load_debug_rollout_data).is_dir():
        yield f"--load-debug-rollout-data {run.load_debug_rollout_data}: directory not found"
    if data.eval_prompt_data and not Path(data.eval_prompt_data).is_file():
        yield f"--eval-prompt-data {data.eval_prompt_data}: file not found"
    if run.eval_interval and not data.eval_prompt_data:
        yield "--eval-interval needs --eval-prompt-data"
    if run.save_interval and not run.save:
        yield "--save-interval needs --save DIR"
    if run.load and not Path(run.load).exists():
        yield f"--load {run.load}: not found"
    for name in ("num_rollout", "num_rollout_workers", "keep_checkpoints", "update_weight_buffer_size"):
        if getattr(run, name) < 1:
            yield f"--{name.replace('_', '-')} must be >= 1"
    if rollout.n_samples_per_prompt < 1:
        yield "--n-samples-per-prompt must be >= 1"
    elif rollout.n_samples_per_prompt < 2 and algo.advantage_estimator in _ESTIMATORS_NEEDING_GROUPS:
        yield (f"--advantage-estimator {algo.advantage_estimator} compares samples of one prompt: "
               "it needs --n-samples-per-prompt >= 2")
    if algo.advantage_estimator == "ppo":
        # The GAE estimator is in miles.algorithms; no trainer has a critic (value model) yet.
        yield ("--advantage-estimator ppo needs critic values, and the trainers have no critic yet: "
               "use grpo, dr_grpo, rloo, reinforce_plus_plus or gspo")
    if rollout.rollout_max_response_len < 1:
        yield "--rollout-max-response-len must be >= 1"
    if rollout.rollout_temperature < 0:
        yield "--rollout-temperature must be >= 0"
    if not 0 < rollout.rollout_top_p <= 1:
        yield "--rollout-top-p must be in (0, 1]"
    if rollout.max_inflight_per_worker < 1:
        yield "--max-inflight-per-worker must be >= 1"
    if run.max_failed_groups_in_a_row < 0:
        yield "--max-failed-groups-in-a-row must be >= 0 (0: never stop)"
    if run.num_reward_workers < 0:
        yield "--num-reward-workers must be >= 0"
    gpus = run.actor_num_gpus_per_node + run.rollout_num_gpus
    trainer_gpus = run.actor_num_gpus_per_node * run.actor_num_nodes
    if run.colocate and run.rollout_num_gpus and run.rollout_num_gpus != trainer_gpus:
        yield "--colocate shares the trainer's GPUs: leave --rollout-num-gpus unset or equal to the trainer's"
    if trainer_gpus > 1 and run.train_backend != "megatron":
        # The PolicyTrainer actor is one process; FSDP2 needs a torchrun launch (library use).
        yield (f"the embedded trainer trains on one GPU in a run, not {trainer_gpus}: set "
               "--actor-num-gpus-per-node 1, or --train-backend megatron for several")
    if not run.colocate and trainer_gpus and not run.rollout_num_gpus and run.rollout_backend == "embedded":
        yield ("--actor-num-gpus-per-node without --colocate gives the trainer its GPUs alone: set "
               "--rollout-num-gpus for the engines' own GPUs, or --colocate to share the trainer's")
    yield from _node_problems(run)
    if run.rollout_num_gpus and not trainer_gpus:
        yield "--rollout-num-gpus needs the trainer on GPUs too: set --actor-num-gpus-per-node"
    if (not run.colocate and run.rollout_num_gpus and run.rollout_backend == "embedded"
            and run.num_rollout_workers > run.rollout_num_gpus):
        # NCCL refuses two ranks of one group on one GPU, so disaggregated workers do not share.
        yield (f"--num-rollout-workers {run.num_rollout_workers} > --rollout-num-gpus {run.rollout_num_gpus}: "
               "each disaggregated rollout worker takes a GPU of its own (or --colocate them)")
    if run.true_on_policy and (run.train_backend != "embedded" or run.rollout_backend != "embedded"):
        yield "--true-on-policy needs the embedded trainer and engines (one model definition on both sides)"
    if gpus and run.deterministic:
        yield "--deterministic is a CPU feature (bitwise resume); it is not supported with GPUs"
    if run.deterministic and (sched.mode != "sync" or sched.over_sampling_batch_size):
        # Only the synchronous schedule makes every token's policy version independent of
        # timing; async modes train on whatever finished first.
        yield "--deterministic needs --mode sync without --over-sampling-batch-size"
    yield from _engine_problems(cfg.engine, embedded=run.rollout_backend == "embedded")
    yield from _compile_problems((cfg.engine, cfg.trainer))
    yield from _env_problems(cfg)
    yield from _agent_problems(cfg)
    yield from _megatron_problems(cfg)
    yield from transport_problems(cfg)
    yield from _quant_problems(cfg)
    yield from _lora_problems(cfg)
    if cfg.trainer.offload_train and not (run.colocate and run.train_backend == "embedded"
                                          and cfg.trainer.device.startswith("cuda")):
        yield ("--offload-train moves the trainer's optimizer state off the GPU while colocated engines "
               "generate: it needs --colocate, --train-backend embedded and the trainer on a GPU "
               "(--device cuda); without them nothing shares its memory")
    if cfg.engine.offload_rollout and not run.colocate:
        yield (f"--offload-rollout releases the engines' memory while a trainer on the same GPU runs: it needs "
               f"--colocate (--mode {sched.mode} without it gives the engines GPUs of their own, and in async "
               f"modes they never wait for the trainer)")
    if cfg.engine.offload_rollout and run.rollout_backend != "embedded":
        yield "--offload-rollout needs --rollout-backend embedded (an SGLang server manages its own memory)"
    if cfg.engine.offload_rollout and cfg.speculative.enabled:
        yield "--offload-rollout cannot be combined with speculative decoding yet (drop --speculative-algorithm)"
    spec = getattr(cfg, "speculative", None)
    if spec is not None and spec.draft_model_path and not (Path(spec.draft_model_path) / "config.json").is_file():
        yield f"--draft-model-path {spec.draft_model_path}: no config.json there"
    if (spec is not None and spec.enabled and run.rollout_backend == "sglang" and cfg.sglang.sglang_launch
            and not spec.draft_model_path
            and not any(k.lstrip("-").replace("_", "-") in ("speculative-draft-model-path", "speculative-draft-model")
                        for k in cfg.sglang.sglang_server_args)):
        yield "--speculative-algorithm with a launched SGLang server needs --draft-model-path (the draft checkpoint)"
    if spec is not None and spec.enabled and run.rollout_backend != "embedded" and spec.enable_draft_training:
        yield "--enable-draft-training needs the embedded rollout engine (SGLang cannot load draft updates yet)"
    if sched.mode == "sync" and sched.over_sampling_batch_size and not rollout.partial_rollout:
        # Over-sampled groups would finish on old weights and be dropped as stale.
        yield "--mode sync with --over-sampling-batch-size needs --partial-rollout (or a non-sync mode)"


def _engine_problems(engine: Any, *, embedded: bool = True):
    """The embedded engine's settings, for ``miles train``'s engines and ``miles serve``'s.
    ``embedded``: the run's engines are the embedded ones (not SGLang servers)."""
    if engine.deterministic and engine.cpu_decode_kernel:
        # its batch-invariant padded steps run on torch ops; the kernel sums in its own order
        yield "--deterministic keeps the torch decode path: drop --cpu-decode-kernel"
    if engine.decode_attention not in DECODE_ATTENTION:
        yield (f"--decode-attention {engine.decode_attention!r}: choose {', '.join(DECODE_ATTENTION[:-1])} "
               f"or {DECODE_ATTENTION[-1]}")
    elif engine.decode_attention == "triton" and embedded and not str(engine.device).startswith("cuda"):
        yield (f"--decode-attention triton is a CUDA kernel; the engines run on {engine.device!r} "
               "(use auto, or --device cuda)")
    problem = chunk_problem(engine.decode_attention_chunk)
    if problem is not None:
        yield f"--decode-attention-chunk {engine.decode_attention_chunk}: {problem}"
    if engine.kv_cache_dtype not in KV_CACHE_DTYPES:
        yield f"--kv-cache-dtype {engine.kv_cache_dtype!r}: choose {', '.join(KV_CACHE_DTYPES)}"
    elif engine.kv_cache_dtype != "auto" and not embedded:
        # the flag sizes the embedded engine's cache; an SGLang server takes its own
        yield (f"--kv-cache-dtype is the embedded engine's; an SGLang server takes its own: "
               f"--sglang-kv-cache-dtype {engine.kv_cache_dtype}")
    elif engine.kv_cache_dtype != "auto" and engine.cpu_decode_kernel and not engine.deterministic:
        yield (f"--kv-cache-dtype {engine.kv_cache_dtype} and --cpu-decode-kernel: the CPU decode kernel reads "
               "a cache in the engine's own dtype (drop one of them)")


def _compile_problems(sections: tuple[Any, ...]):
    """``--compile`` on the CPU for any of ``sections`` (configs with ``compile`` and ``device``)."""
    cpu_compile = [section for section in sections if section.compile and not str(section.device).startswith("cuda")]
    if cpu_compile and not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        yield ("--compile on the CPU needs a C++ compiler on PATH (c++, g++ or clang++) for torch's inductor; "
               "install one, or leave --compile off (the CPU default)")


def check_serve(serve: Any, engine: Any, speculative: Any, *, speculative_flags: Sequence[str] = ()) -> None:
    """``miles serve``'s cross-field checks (``ServeConfig``, ``EngineConfig``, the
    ``SpeculativeConfig`` of SGLang's ``--speculative-*`` flags, which ``speculative_flags``
    names); raise ``ConfigError`` listing every problem, as ``check_config`` does for a run."""
    from miles.config import ConfigError

    problems = list(_serve_problems(serve, engine, speculative, speculative_flags))
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def _serve_problems(serve: Any, engine: Any, speculative: Any, speculative_flags: Sequence[str]):
    import torch

    if not serve.hf_checkpoint:
        yield "--hf-checkpoint (or --model-path) is required"
    if str(engine.device).startswith("cuda") and not torch.cuda.is_available():
        yield f"--device {engine.device}: CUDA is not available on this machine"
    if speculative_flags and not speculative.enabled:
        yield "--speculative-* flags need --speculative-algorithm"
    if speculative.enabled and not speculative.draft_model_path:
        yield "--speculative-algorithm needs --speculative-draft-model-path (a served draft must be trained)"
    yield from _engine_problems(engine)
    yield from _compile_problems((engine,))


def _lora_problems(cfg: Any):
    """LoRA (miles.trainers.lora): the backends it runs on, and targets and rank checked against
    the checkpoint's shapes (a meta model, no weights read) before any actor starts."""
    t, run = cfg.trainer, cfg.run
    if t.lora_rank <= 0:
        return
    if run.train_backend != "embedded":
        yield (f"--lora-rank needs --train-backend embedded (the Megatron backend trains full parameters "
               f"only); drop --lora-rank or use --train-backend embedded")
    if run.rollout_backend != "embedded":
        yield "--lora-rank needs --rollout-backend embedded (its engines apply the adapter updates)"
    if cfg.quant.quantization != "none" or cfg.quant.rollout_quantization != "none":
        yield "--lora-rank cannot be combined with --quantization/--rollout-quantization yet"
    if cfg.weights.weight_update_changed_only:
        yield "--weight-update-changed-only is for full weights: a LoRA update already ships only the adapters"
    path = cfg.rollout.hf_checkpoint
    if not path or not (Path(path) / "config.json").is_file():
        return
    from miles.models import CheckpointError, load_config
    from miles.models.checkpoint import _meta_model
    from miles.trainers.lora import lora_problems

    try:
        model = _meta_model(load_config(path))
    except CheckpointError:
        return  # reported by the checkpoint check
    yield from lora_problems(model, t.lora_rank, t.lora_target_modules)


def _quant_problems(cfg: Any):
    """Low precision (miles.models.quant): what each mode needs, checked against the checkpoint's
    shapes (a meta model, no weights read) and the device, before any actor starts."""
    q, run = cfg.quant, cfg.run
    if q.quantization == "none" and q.rollout_quantization == "none":
        return
    if q.quantization != "none" and q.rollout_quantization != "none":
        yield (f"--quantization {q.quantization} already quantizes the engines: drop --rollout-quantization "
               f"(it is the bf16-training mode)")
    if run.rollout_backend != "embedded":
        yield "--quantization/--rollout-quantization need --rollout-backend embedded (SGLang takes its own --quantization)"
    if q.quantization != "none" and run.train_backend != "embedded":
        yield f"--quantization {q.quantization} needs --train-backend embedded"
    if q.quantization != "none" and cfg.weights.weight_update_changed_only:
        yield "--weight-update-changed-only cannot ship quantized weights (a weight and its scales travel together)"
    path = cfg.rollout.hf_checkpoint
    if not path or not (Path(path) / "config.json").is_file():
        return
    import torch

    from miles.models import CausalLM, load_config
    from miles.models.quant import apply_quantization, check_device

    for spec, device in ((q.engine_spec(), cfg.engine.device), (q.trainer_spec(), cfg.trainer.device)):
        if spec is None:
            continue
        try:
            with torch.device("meta"):
                apply_quantization(CausalLM(load_config(path)), spec)
        except ValueError as exc:
            yield str(exc)
            return
        problem = check_device(spec, device)
        if problem:
            yield problem


def _megatron_problems(cfg: Any):
    run = cfg.run
    if run.train_backend != "megatron":
        return
    import importlib.util

    from miles.trainers.megatron.config import MegatronConfigError, data_parallel_size
    from miles.trainers.megatron.launch import megatron_section

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        yield "--train-backend megatron needs megatron-core: pip install 'miles[megatron]'"
    if run.actor_num_gpus_per_node < 1:
        yield "--train-backend megatron trains on GPUs: set --actor-num-gpus-per-node (1 or more)"
        return
    world = run.actor_num_nodes * run.actor_num_gpus_per_node
    try:
        data_parallel_size(megatron_section(cfg), world)
    except MegatronConfigError as exc:
        yield f"{exc} (trainer world: {world} GPUs)"


def _node_problems(run: Any):
    """--actor-num-nodes / --rollout-num-nodes (miles.actors.placement places by node)."""
    if run.actor_num_nodes < 1:
        yield "--actor-num-nodes must be >= 1"
    if run.rollout_num_nodes < 0:
        yield "--rollout-num-nodes must be >= 0 (0: the workers go where Ray puts them)"
    if run.actor_num_nodes > 1 and run.train_backend != "megatron":
        yield (f"--actor-num-nodes {run.actor_num_nodes}: the embedded trainer is one process on one node; "
               "use --train-backend megatron for a trainer across nodes")
    if run.colocate and run.rollout_num_nodes not in (0, run.actor_num_nodes):
        yield "--colocate puts the engines on the trainer's nodes: leave --rollout-num-nodes unset or equal to --actor-num-nodes"
    if run.rollout_num_nodes and run.rollout_num_gpus and run.rollout_num_gpus % run.rollout_num_nodes:
        yield (f"--rollout-num-gpus {run.rollout_num_gpus} does not split evenly over --rollout-num-nodes "
               f"{run.rollout_num_nodes}")


def _env_problems(cfg: Any):
    env, rollout = cfg.env, cfg.rollout
    if not env.env_path:
        return
    if cfg.trainer.use_rollout_routing_replay:
        # Replay needs a routing for every response position; tokens an environment writes
        # were never routed by the engine (they are prefilled as context of the next turn).
        yield "--use-rollout-routing-replay does not support --env-path yet: environment tokens have no recorded routing"
    if rollout.custom_generate_function_path:
        yield "--env-path and --custom-generate-function-path both choose the generate function: set one"
    if env.env_reward == "none" and not rollout.custom_rm_path:
        yield "--env-reward none leaves the reward to --custom-rm-path, which is not set"
    module = env.env_path.rsplit(":", 1)[0]
    if (module.endswith(".py") or "/" in module) and not Path(module).is_file():
        yield f"--env-path {env.env_path}: file {module} not found"


def _agent_problems(cfg: Any):
    ref = cfg.agent.custom_agent_function_path
    if not ref:
        return
    for flag, other in (("--env-path", cfg.env.env_path),
                        ("--custom-generate-function-path", cfg.rollout.custom_generate_function_path)):
        if other:
            yield f"--custom-agent-function-path and {flag} both choose the generate function: set one"
    if cfg.trainer.use_rollout_routing_replay:
        yield "--use-rollout-routing-replay does not support --custom-agent-function-path: tool tokens have no routing"
    module = ref.rsplit(":", 1)[0]
    if (module.endswith(".py") or "/" in module) and not Path(module).is_file():
        yield f"--custom-agent-function-path {ref}: file {module} not found"


def check_functions(cfg: Any) -> None:
    """Resolve every user function path once, so a typo fails before anything starts."""
    from miles.utils.loading import load_function

    for flag, ref in (
        ("--custom-rm-path", cfg.rollout.custom_rm_path),
        ("--custom-generate-function-path", cfg.rollout.custom_generate_function_path),
        ("--dynamic-sampling-filter-path", cfg.rollout.dynamic_sampling_filter_path),
        ("--env-path", cfg.env.env_path),
        ("--custom-agent-function-path", cfg.agent.custom_agent_function_path),
    ):
        if ref:
            load_function(ref)
