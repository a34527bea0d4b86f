"""Builds each component from the run's config, inside the process that will run it.

This is where flags become objects: the checkpoint is loaded where the engine or trainer
lives, ``"pkg.mod:fn"`` strings become callables (only here and in ``miles.utils.loading``),
and the values one component derives from another's flags are set once — the buffer's
η comes from the scheduler's mode, seeds from ``--seed``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import random
import time
from typing import Any

import msgspec
import numpy as np
import torch

from miles.config import MilesConfig
from miles.data import PromptDataset
from miles.rewards import RewardRunner
from miles.rollout import GenerateContext, load_generate_fn
from miles.types import SamplingParams
from miles.utils import gcpolicy
from miles.utils.loading import load_function

log = logging.getLogger(__name__)


def configure_process(cfg: MilesConfig, threads: int) -> None:
    """Threads, seeds, determinism and the GC policy (``miles.utils.gcpolicy``) for an
    actor process."""
    gcpolicy.install()
    torch.set_num_threads(max(1, threads))
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed % (2**32))
    torch.manual_seed(cfg.run.seed)
    cuda = any(str(d).startswith("cuda") for d in (cfg.engine.device, cfg.trainer.device))
    if cfg.run.deterministic or cfg.run.true_on_policy:
        # On CUDA the mode needs its forwards deterministic (their reductions are the Triton
        # kernels'; index_add_ has a deterministic form); an op of the trainer's backward
        # without one warns instead of stopping the run: gradients are not compared.
        torch.use_deterministic_algorithms(True, warn_only=cuda and not cfg.run.deterministic)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if cfg.run.true_on_policy:  # every actor process: the engine's and the trainer's forwards alike
        from miles.models import invariant

        invariant.enable(keys=context_len(cfg), device="cuda" if cuda else "cpu")
        invariant.skip_uninitialized_fill()


def load_tokenizer(cfg: MilesConfig) -> Any:
    from miles.models import load_tokenizer as _load

    return _load(cfg.rollout.hf_checkpoint)


def load_datasets(cfg: MilesConfig) -> tuple[PromptDataset, PromptDataset | None]:
    from miles.models import load_config

    tokenizer = load_tokenizer(cfg)
    d = cfg.data
    common = dict(tokenizer=tokenizer, input_key=d.input_key, label_key=d.label_key,
                  metadata_key=d.metadata_key, apply_chat_template=d.apply_chat_template,
                  add_special_tokens=d.add_special_tokens,
                  max_prompt_len=_max_prompt_len(cfg), on_bad_data=d.on_bad_data,
                  vocab_size=load_config(cfg.rollout.hf_checkpoint).vocab_size)
    train = PromptDataset(d.prompt_data, shuffle=d.rollout_shuffle, seed=cfg.run.seed, **common)
    evaluation = PromptDataset(d.eval_prompt_data, **common) if d.eval_prompt_data else None
    return train, evaluation


def context_len(cfg: MilesConfig) -> int:
    """The engine's context: --max-seq-len, capped by the model's max_position_embeddings."""
    from miles.models import load_config

    return min(cfg.engine.max_seq_len, load_config(cfg.rollout.hf_checkpoint).max_position_embeddings)


def _max_prompt_len(cfg: MilesConfig) -> int:
    """A prompt must leave room for at least one response token in the engine's context."""
    limit = context_len(cfg) - 1
    return min(limit, cfg.data.max_prompt_len) if cfg.data.max_prompt_len else limit


def buffer_args(cfg: MilesConfig) -> dict[str, Any]:
    from miles.buffers import BufferConfig, drop_uniform_rewards  # noqa: F401 - named in docs

    policy = cfg.buffer.stale_policy
    if policy == "auto":
        policy = "mask" if cfg.rollout.partial_rollout else "drop"
    config = msgspec.structs.replace(
        cfg.buffer,
        max_staleness=cfg.scheduler.staleness,
        n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
        stale_policy=policy,
    )
    filters = []
    if cfg.rollout.dynamic_sampling_filter_path:
        fn = load_function(cfg.rollout.dynamic_sampling_filter_path)
        key = cfg.rollout.reward_key
        if key and "reward_key" in inspect.signature(fn).parameters:  # judge the reward the trainer uses
            name = getattr(fn, "name", None) or fn.__name__
            fn = functools.partial(fn, reward_key=key)
            fn.name = name  # type: ignore[attr-defined] - the reason its drops are counted under
        filters.append(fn)
    return {"config": config, "group_filters": filters}


def wants_shared_base(cfg: MilesConfig) -> bool:
    """Whether a rollout worker asks the trainer for its frozen base (``miles.engines.shared``):
    colocated LoRA with embedded engines and trainer, on the plain decode path (quantized,
    speculative and true-on-policy engines, and adapters on the LM head, keep their own copy
    and merge the adapters: the unmerged path covers the decoder's seven projections)."""
    from miles.trainers.lora import PROJECTIONS

    targets = set(cfg.trainer.lora_target_modules)
    return (cfg.run.colocate and cfg.trainer.lora_rank > 0 and cfg.run.rollout_backend == "embedded"
            and targets <= {*PROJECTIONS, "all-linear"}
            and cfg.run.train_backend == "embedded" and not cfg.speculative.enabled and not cfg.run.true_on_policy
            and cfg.quant.engine_spec() is None)


COLOCATED_ACTIVATION_BUDGET = 24 * 2**30  # a colocated trainer's micro-batch activations when no limit is set
COLOCATED_MAX_TOKENS = 32768  # and at most this many tokens a micro-batch


def _colocated_embedded_cuda(cfg: MilesConfig) -> bool:
    return cfg.run.colocate and cfg.run.train_backend == "embedded" and cfg.engine.device.startswith("cuda")


def colocated_micro_batch_tokens(cfg: MilesConfig, model_config: Any) -> int | None:
    """The token cap of a colocated embedded trainer's micro-batches where the user set neither
    --micro-batch-size nor --max-tokens-per-micro-batch (None elsewhere). Without a cap a
    step is one micro-batch, and the engine's memory plan, made before any step, would have
    to keep a whole step's activations at the full context free (646 GiB for 256 rows of a
    Qwen3-0.6B shape at 2,048 tokens): the engine got no KV cache at all. The cap is the
    largest power of two of tokens whose activations fit ``COLOCATED_ACTIVATION_BUDGET``, at
    most ``COLOCATED_MAX_TOKENS``, and at least one sequence of the full context. The plan
    and the trainer both take it (``colocated_trainer_bytes``, ``build_policy_trainer``)."""
    t = cfg.trainer
    if not _colocated_embedded_cuda(cfg) or t.micro_batch_size or t.max_tokens_per_micro_batch:
        return None
    one, two = (_activation_bytes(cfg, model_config, n) for n in (1, 2))
    fit = max(1, (COLOCATED_ACTIVATION_BUDGET - (2 * one - two)) // (two - one))
    tokens = min(1 << (fit.bit_length() - 1), COLOCATED_MAX_TOKENS)
    return max(tokens, min(cfg.engine.max_seq_len, model_config.max_position_embeddings))


def colocated_trainer_bytes(cfg: MilesConfig, model_config: Any, num_params: int, *,
                            shared_base: bool = False) -> tuple[int, int] | None:
    """(resident state, micro-batch activation) bytes of the embedded trainer that shares the
    engine's GPU, for the engine's memory plan; None where no trainer does. The micro-batch
    is --max-tokens-per-micro-batch, else its rows (--micro-batch-size) padded to the
    context, else ``colocated_micro_batch_tokens``. With --offload-rollout the engines
    release their KV cache while the trainer runs, so only the state that stays between
    steps counts; a LoRA engine over the trainer's base already holds that base (it is in
    the engine's weights)."""
    from miles.engines.memory import trainer_state_bytes

    if not _colocated_embedded_cuda(cfg):
        return None
    t = cfg.trainer
    lora = t.lora_rank > 0
    state = 0 if shared_base else trainer_state_bytes(num_params, 0 if lora else num_params,
                                                      offload_train=t.offload_train, lora=lora)
    if cfg.engine.offload_rollout:
        return state, 0
    tokens = (t.max_tokens_per_micro_batch or (t.micro_batch_size and t.micro_batch_size * context_len(cfg))
              or colocated_micro_batch_tokens(cfg, model_config))
    return state, _activation_bytes(cfg, model_config, tokens)


def _activation_bytes(cfg: MilesConfig, model_config: Any, tokens: int) -> int:
    """``trainer_activation_bytes`` of a micro-batch of ``tokens`` in the trainer's compute dtype."""
    from miles.engines.memory import trainer_activation_bytes

    t = cfg.trainer
    dtype = torch.float32 if t.dtype == "float32" else torch.bfloat16
    return trainer_activation_bytes(model_config, tokens, dtype, checkpointing=t.gradient_checkpointing)


def build_engine(cfg: MilesConfig, *, seed_offset: int = 0, index: int = 0, base_offer: Any = None) -> Any:
    """The rollout engine of worker ``index``: embedded torch, or an SGLang server.
    ``base_offer``: a colocated LoRA trainer's ``base_offer()``; the engine serves that base
    (one copy on the GPU, adapters unmerged) where it can, else loads its own and says why."""
    if cfg.run.rollout_backend == "sglang":
        from miles.engines.sglang import build_sglang_engine

        return build_sglang_engine(cfg, index=index)
    from miles.engines import EmbeddedEngine
    from miles.models import load_pretrained

    tok_start = time.perf_counter()
    tokenizer = load_tokenizer(cfg)
    tokenizer_s = time.perf_counter() - tok_start
    engine_cfg = msgspec.structs.replace(cfg.engine, seed=cfg.run.seed + seed_offset, max_seq_len=context_len(cfg))
    if cfg.run.true_on_policy:  # the torch decode path, whose GEMMs and attention invariant.enable replaces
        # (eager: compiled layer functions would fuse RMSNorm, RoPE and SiLU·up in their own
        # rounding; the fused sampler's tokens get their log-probs from the mode's log-sum-exp,
        # the trainer's)
        engine_cfg = msgspec.structs.replace(engine_cfg, decode_attention="sdpa", cpu_decode_kernel=False,
                                             decode_residual_gemm=False, decode_fused_mlp=False, compile=False)
    if base_offer is not None:
        from miles.engines import shared
        from miles.models import load_config

        model_cfg = load_config(cfg.rollout.hf_checkpoint)
        base, why = shared.open_offer(base_offer, model_cfg, engine_cfg.device, engine_cfg.torch_dtype())
        if base is not None:
            trainer = colocated_trainer_bytes(cfg, model_cfg, sum(t.numel() for t in base.values()), shared_base=True)
            engine = EmbeddedEngine.over_shared_base(model_cfg, base, config=engine_cfg, tokenizer=tokenizer,
                                                     colocated_trainer=trainer)
            log.warning("LoRA: the engine serves the colocated trainer's frozen base (%.1f GiB, one copy on the "
                        "GPU) and applies the adapters unmerged (engine/lora_shared_base = 1)",
                        shared.shared_bytes(engine.model, engine.shared) / 2**30)
            engine.start()
            return engine
        log.warning("LoRA: the engine loads its own copy of the base and merges the adapters "
                    "(engine/lora_shared_base = 0): %s", why)
    start = time.perf_counter()
    if engine_cfg.device.startswith("cuda"):  # the process's CUDA start, timed apart from the load
        torch.zeros(1, device=engine_cfg.device)
    cuda_s = time.perf_counter() - start
    model = load_pretrained(cfg.rollout.hf_checkpoint, device=engine_cfg.device)
    load_s = time.perf_counter() - start - cuda_s
    trainer = colocated_trainer_bytes(cfg, model.config, sum(p.numel() for p in model.parameters()))
    from miles.models.quant import apply_quantization

    apply_quantization(model, cfg.quant.engine_spec())
    draft = build_draft_model(cfg, model.config) if cfg.speculative.enabled else None
    engine = EmbeddedEngine(model, config=engine_cfg, tokenizer=tokenizer, draft=draft, speculative=cfg.speculative,
                            colocated_trainer=trainer)
    engine.init_parts.update({"tokenizer": tokenizer_s, "cuda_start": cuda_s, "load_checkpoint": load_s})
    engine.start()
    return engine


def build_draft_model(cfg: MilesConfig, policy_config: Any) -> Any:
    """The draft every engine and the DraftTrainer start from: ``--draft-model-path``, or a
    fresh one initialised from ``--seed`` (identical in every process)."""
    from miles.models.draft import build_draft, draft_kind, load_draft

    sc = cfg.speculative
    if sc.draft_model_path:
        draft = load_draft(sc.draft_model_path, dtype=torch.float32)
        if draft_kind(draft) != sc.speculative_algorithm:
            raise ValueError(f"--draft-model-path {sc.draft_model_path} holds a {draft_kind(draft)!r} draft, "
                             f"but --speculative-algorithm is {sc.speculative_algorithm!r}")
        return draft
    return build_draft(sc.speculative_algorithm, policy_config, num_layers=sc.draft_num_hidden_layers,
                       hidden_size=sc.draft_hidden_size, seed=cfg.run.seed)


def build_draft_trainer(cfg: MilesConfig) -> Any:
    """The DraftLearner for the DraftTrainer actor (a policy copy when the head or KL needs it)."""
    from miles.models import load_config, load_pretrained
    from miles.trainers.draft import DraftLearner

    sc = cfg.speculative
    device = cfg.trainer.device if torch.cuda.is_available() else "cpu"
    draft = build_draft_model(cfg, load_config(cfg.rollout.hf_checkpoint))
    policy = None
    if sc.speculative_algorithm == "eagle" or sc.draft_kl_coef > 0:
        policy = load_pretrained(cfg.rollout.hf_checkpoint, dtype=torch.float32, device="cpu")
    return DraftLearner(draft, policy=policy, lr=sc.draft_lr, kl_coef=sc.draft_kl_coef,
                        temperature=cfg.rollout.rollout_temperature or 1.0,
                        micro_batch_size=sc.draft_micro_batch_size, device=device)


def sampling_params(cfg: MilesConfig, tokenizer: Any) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        max_new_tokens=r.rollout_max_response_len,
        temperature=r.rollout_temperature,
        top_p=r.rollout_top_p,
        top_k=r.rollout_top_k,
        stop=list(r.rollout_stop),
        stop_token_ids=list(r.rollout_stop_token_ids),
    )


def build_generate_fn(cfg: MilesConfig, tokenizer: Any) -> Any:
    """``--env-path``: the multi-turn Env rollout; ``--custom-agent-function-path``: the
    user's OpenAI-client agent; else the default or custom function."""
    if cfg.agent.custom_agent_function_path:
        from miles.agent import build_agent_rollout

        return build_agent_rollout(cfg)
    if cfg.env.env_path:
        from miles.rollout import build_env_rollout

        return build_env_rollout(cfg, tokenizer)
    return load_generate_fn(cfg.rollout.custom_generate_function_path)


def build_reward_runner(cfg: MilesConfig) -> tuple[Any, dict[str, Any]]:
    return cfg.rollout.custom_rm_path, {"timeout_s": cfg.rollout.reward_timeout_s, "args": cfg}


def records_routing(cfg: MilesConfig) -> bool:
    """Whether rollouts record routed experts: routing replay is on and the model is MoE."""
    if not cfg.trainer.use_rollout_routing_replay:
        return False
    from miles.models import load_config

    return load_config(cfg.rollout.hf_checkpoint).is_moe


def build_rollout_worker(cfg: MilesConfig, worker_id: str, *, buffer: Any, rewards: list[Any],
                         base_offer: Any = None) -> dict[str, Any]:
    """Keyword arguments for ``RolloutWorker`` (everything but the id)."""
    ordinal = int(worker_id.split("-")[0].removeprefix("worker") or 0)  # "worker3-1a2b3c" → 3
    engine = build_engine(cfg, seed_offset=ordinal, index=ordinal, base_offer=base_offer)
    tokenizer = getattr(engine, "tokenizer", None) or load_tokenizer(cfg)
    ctx = GenerateContext(
        engine=engine,
        tokenizer=tokenizer,
        sampling=sampling_params(cfg, tokenizer),
        max_response_len=cfg.rollout.rollout_max_response_len,
        seed=cfg.run.seed,
        config=cfg,
        record_routing=records_routing(cfg),
    )
    local_reward = None
    if not rewards and cfg.rollout.custom_rm_path:
        fn, kwargs = build_reward_runner(cfg)
        local_reward = RewardRunner(fn, **kwargs)
    return {
        "engine": engine,
        "context": ctx,
        "generate_fn": build_generate_fn(cfg, tokenizer),
        "buffer": buffer,
        "rewards": rewards,
        "local_reward": local_reward,
        "max_inflight": cfg.rollout.max_inflight_per_worker,
        "partial_rollout": cfg.rollout.partial_rollout,
        "keep_kv_cache": cfg.engine.keep_kv_cache_on_update,
        "lease_timeout_s": cfg.buffer.lease_timeout_s,
        "reward_key": cfg.rollout.reward_key,
        # updates that carry adapters or changed tensors only cannot refill released weights
        "offload_weights": ("host" if cfg.trainer.lora_rank > 0 or cfg.weights.weight_update_changed_only
                            else "discard"),
    }


def build_weight_sender(cfg: MilesConfig) -> tuple[Any, torch.dtype | None]:
    """The trainer's weight sender for ``--weight-transport`` (``auto`` resolved), and the
    dtype weights travel in: the embedded engines' dtype (half the bytes of the trainer's
    float32 on GPUs), or the trainer's own for SGLang (its server casts on load)."""
    from miles.transports import make_sender, resolve_transport

    dtype = cfg.engine.torch_dtype() if cfg.run.rollout_backend == "embedded" else None
    sender = make_sender(resolve_transport(cfg), device=cfg.trainer.device, dtype=dtype, use_ray=True,
                         timeout_s=cfg.weights.weight_transport_timeout_s)
    return sender, dtype


def build_policy_trainer(cfg: MilesConfig) -> Any:
    """The trainer backend of ``--train-backend``: the embedded torch trainer, or Megatron-core
    (one rank in this process, or a RayRankGroup of one Ray actor per GPU)."""
    if cfg.run.train_backend == "megatron":
        from miles.trainers.megatron import build_megatron_trainer

        return build_megatron_trainer(cfg)
    from miles.models import load_pretrained
    from miles.trainers import EmbeddedTrainer

    trainer_cfg = msgspec.structs.replace(cfg.trainer, seed=cfg.run.seed)
    from miles.models import load_config

    cap = colocated_micro_batch_tokens(cfg, load_config(cfg.rollout.hf_checkpoint))
    if cap is not None:  # the engine's memory plan left room for micro-batches of this size
        log.info("colocated trainer: micro-batches of at most %d tokens (--max-tokens-per-micro-batch sets it)", cap)
        trainer_cfg = msgspec.structs.replace(trainer_cfg, max_tokens_per_micro_batch=cap)
    if cfg.run.true_on_policy:  # eager layers: the engine's rounding of each op (models.invariant);
        # every row forward, so the reported rollout/trainer log-prob difference covers them all
        trainer_cfg = msgspec.structs.replace(trainer_cfg, compile=False, zero_advantage_rows="forward")
    # A LoRA trainer keeps its frozen base in the compute dtype: loaded so, it never holds a float32 copy.
    from miles.trainers.embedded import _dtype

    load_dtype = _dtype(trainer_cfg.dtype, trainer_cfg.device) if trainer_cfg.lora_rank > 0 else torch.float32
    model = load_pretrained(cfg.rollout.hf_checkpoint, dtype=load_dtype, device=trainer_cfg.device)
    from miles.models.quant import apply_quantization

    apply_quantization(model, cfg.quant.trainer_spec())
    ref_model = None
    if cfg.algorithm.kl_coef > 0 or getattr(cfg.algorithm, "reward_kl_coef", 0) > 0:
        ref_model = load_pretrained(cfg.rollout.hf_checkpoint, dtype=torch.float32, device=trainer_cfg.device)
    return EmbeddedTrainer(model, config=trainer_cfg, algo=cfg.algorithm, ref_model=ref_model)
