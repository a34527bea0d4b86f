"""The run's configuration: one typed struct per component, one flat flag namespace.

Each component owns a msgspec struct in its ``config.py`` (``BufferConfig`` in ``miles.buffers``,
``RolloutConfig`` in ``miles.rollout``, ...); the run's own two (``RunConfig``, ``DataConfig``)
are here, and ``SECTIONS`` lists them all. ``MilesConfig`` holds one of each, by section name. Flags are the
field names with ``_`` → ``-`` (``--rollout-batch-size``), following slime's names where slime
has one. A field that two components share (``max_staleness`` is read by the scheduler and
the buffer) is one flag that sets both, so they can never disagree.

Precedence: defaults < YAML file (``--config``; flat ``flag-name: value`` keys, or nested by
section) < command-line flags. ``resolve()`` validates everything once (types, choices and
cross-field rules), and the driver writes the result to ``OUTPUT_DIR/config.yaml``.

The struct → argparse bridge (``add_field_flag``: types, ``Literal`` choices, ``--no-`` bools,
help from each field's comment; ``build_struct``: validation with the flag named) is the one
``miles serve`` builds its flags with too (``add_struct_flags``); the cross-field checks of
both commands are in ``miles.validation``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import yaml

T = TypeVar("T")


class RunConfig(msgspec.Struct, kw_only=True):
    """Where outputs go, how long to run, placement, checkpoints, debugging."""

    output_dir: str = "outputs/run"  # metrics.jsonl, summary.json, dumps, config.yaml go here
    # backends: the embedded torch ones run anywhere; megatron / sglang are optional extras
    train_backend: Literal["embedded", "megatron"] = "embedded"  # the trainer: torch (anywhere) or Megatron-core
    rollout_backend: Literal["embedded", "sglang"] = "embedded"  # the engines: torch (anywhere) or SGLang servers
    num_rollout: int = 10  # trainer steps (slime: --num-rollout)
    seed: int = 1234  # seeds sampling, data order and initialisation
    deterministic: bool = False  # batch-invariant steps and fixed orders: a resumed run repeats exactly
    true_on_policy: bool = False  # batch-invariant engine and trainer (CPU float32, CUDA Triton bf16): rollout log-probs bitwise the trainer's
    # placement (GPUs; 0 means CPU)
    actor_num_nodes: int = 1  # nodes of the trainer (slime: actor_num_nodes x actor_num_gpus_per_node trainer GPUs)
    actor_num_gpus_per_node: int = 0  # the trainer's GPUs per node (0: CPU)
    rollout_num_gpus: int = 0  # GPUs of the rollout engines, apart from the trainer's (one worker each)
    rollout_num_nodes: int = 0  # nodes of the rollout workers, beside the trainer's (0: where Ray puts them; docs/cluster.md)
    rollout_num_gpus_per_engine: int = 1  # GPUs per engine (SGLang tensor parallelism)
    num_rollout_workers: int = 1  # rollout workers (one engine each); on the CPU, processes
    num_reward_workers: int = 0  # 0: rewards run inside the rollout workers
    colocate: bool = False  # the engines share the trainer's first GPU (weights by CUDA IPC)
    ray_address: str | None = None  # join this Ray cluster (also --address HOST:PORT; see docs/cluster.md) instead of starting a local one
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


def _sections() -> dict[str, type[Any]]:
    # Imported here so that this registry is the one place that knows every component.
    from miles.agent.config import AgentConfig
    from miles.algorithms import AlgorithmConfig
    from miles.buffers import BufferConfig
    from miles.engines import EngineConfig
    from miles.engines.sglang import SGLangConfig
    from miles.envs.config import EnvConfig
    from miles.engines.spec import SpeculativeConfig
    from miles.models.quant import QuantConfig
    from miles.rollout.config import RolloutConfig
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


class ConfigError(ValueError):
    """The configuration is invalid; the message names the flag or file at fault."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# Developer settings: config fields that are not ``miles train`` flags. They are the engine's
# kernel and scheduling switches (each default is the measured best; ``benchmarks/engine.py
# --side`` compares the alternatives), backend plumbing with working defaults, and tuning
# constants few runs need. A run still sets them, by name, in its YAML file or with
# ``--dev KEY=VALUE`` (repeatable); the resolved config.yaml lists them like every field.
DEV_FIELDS = frozenset({
    # run, data, rollout, scheduler, buffer
    "ray_num_cpus", "health_check_interval_s", "max_failed_groups_in_a_row", "update_weight_buffer_size",
    "save_debug_rollout_data", "load_debug_rollout_data",
    "metadata_key", "eval_max_prompts",
    "rollout_stop_token_ids", "max_inflight_per_worker", "max_inflight", "capacity", "lease_timeout_s",
    # engine: kernel and admission switches
    "max_prefill_tokens", "admit_min", "admit_max_wait_steps", "kv_block", "decode_split",
    "capture_graphs_when_idle", "cpu_decode_kernel", "fused_sampling", "decode_fuse_rope",
    "decode_residual_gemm", "decode_fused_mlp", "decode_attention_chunk",
    "inject_oom_steps",
    # trainer and algorithm constants
    "min_lr", "lr_decay_steps", "adam_beta1", "adam_beta2", "adam_eps", "skip_nonfinite_steps",
    "max_consecutive_nonfinite", "zero_advantage_rows", "compile_warmup", "gamma", "lam", "reward_kl_coef",
    "dual_clip_c", "tis_veto", "loss_agg_max_tokens",
    # Megatron-core internals
    "expert_tensor_parallel_size", "local_core_attention", "make_vocab_size_divisible_by",
    "recompute_method", "recompute_num_layers", "moe_token_dispatcher_type", "moe_router_dtype",
    "moe_aux_loss_coeff", "use_distributed_optimizer",
    # SGLang plumbing
    "sglang_launch_command", "sglang_host", "sglang_port", "sglang_weight_backend",
    "sglang_weight_master_address", "sglang_weight_master_port", "sglang_weight_dir", "sglang_pause_mode",
    "sglang_timeout_s", "sglang_startup_timeout_s",
    # environments, speculative decoding, the draft's training, transports
    "env_stop_token_ids", "env_threads",
    "speculative_num_draft_tokens", "speculative_sampling", "speculative_max_batch_size",
    "speculative_probe_interval", "draft_num_hidden_layers", "draft_hidden_size", "draft_lr", "draft_train_interval",
    "draft_kl_coef", "draft_micro_batch_size", "draft_max_queue", "weight_transport_timeout_s",
})


def _field_table() -> dict[str, list[tuple[str, msgspec.structs.FieldInfo]]]:
    """field name → [(section, field info)], in section order."""
    table: dict[str, list[tuple[str, msgspec.structs.FieldInfo]]] = {}
    for section, cls in SECTIONS.items():
        for info in msgspec.structs.fields(cls):
            table.setdefault(info.name, []).append((section, info))
    return table


def _default(info: msgspec.structs.FieldInfo) -> Any:
    if info.default is not msgspec.NODEFAULT:
        return info.default
    if info.default_factory is not msgspec.NODEFAULT:
        return info.default_factory()
    return None


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else tp), True
    return tp, False


def add_field_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str,
                   info: msgspec.structs.FieldInfo, help: str, *, aliases: Sequence[str] = ()) -> None:
    """The flag ``--name`` (and ``aliases``) of one config field, typed from its annotation:
    a bool is ``--x`` / ``--no-x``, a ``Literal`` lists its choices, a list takes several
    values, a dict takes JSON or ``k=v,...``. Unset flags stay out of the namespace, so a
    YAML file or the struct's default shows through."""
    tp, _optional = _unwrap_optional(info.type)
    kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help.replace("%", "%%")}
    origin = typing.get_origin(tp)
    if tp is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif origin is Literal:
        choices = typing.get_args(tp)
        kwargs["choices"] = choices
        kwargs["type"] = type(choices[0])
    elif origin in (list, tuple):
        item = typing.get_args(tp)[0] if typing.get_args(tp) else str
        kwargs["nargs"] = "*"
        kwargs["type"] = item if item in (int, float, str) else str
    elif origin is dict:
        kwargs["type"] = _parse_mapping
        kwargs["metavar"] = "JSON|k=v,..."
    elif tp in (int, float, str):
        kwargs["type"] = tp
    else:
        kwargs["type"] = str
    parser.add_argument(_flag(name), *aliases, **kwargs)


# Second spellings of a flag (one flag in --help): ``--address`` is Ray's own word for the
# cluster to join (``ray start --address``, ``ray job submit --address``).
ALIASES: dict[str, tuple[str, ...]] = {"ray_address": ("--address",)}


def field_help(comment: str | None, default: Any, where: str | None = None) -> str:
    """A flag's help line: the field's comment, the section(s) it sets, its default."""
    parts = [comment] if comment else []
    if where:
        parts.append(f"[{where}]")
    parts.append(f"default: {default!r}")
    return " ".join(parts)


def add_struct_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                     aliases: dict[str, list[str]] | None = None) -> None:
    """One flag per field of the config struct ``cls`` (``miles serve``'s), built as
    ``miles train`` builds its own: ``add_field_flag``, help from ``field_comments``. A
    developer setting (``DEV_FIELDS``) keeps its flag, with a help line that says only so."""
    comments = field_comments(cls)
    for info in msgspec.structs.fields(cls):
        text = "(developer setting)" if info.name in DEV_FIELDS else comments.get(info.name)
        add_field_flag(parser, info.name, info, field_help(text, _default(info)),
                       aliases=(aliases or {}).get(info.name, ()))


def build_struct(cls: type[T], values: dict[str, Any], section: str | None = None) -> T:
    """``cls`` from flat field values, types and the struct's own checks validated; a
    problem is a ``ConfigError`` naming the flag."""
    try:
        return msgspec.convert(values, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, section or cls.__name__)) from None
    except (ValueError, TypeError) as exc:  # a struct's own __post_init__ check
        raise ConfigError(str(exc)) from None


def _parse_mapping(text: str) -> dict[str, Any]:
    """``--env-kwargs '{"a": 1}'`` or ``--env-kwargs a=1,b=x``."""
    text = text.strip()
    if text.startswith("{"):
        value = yaml.safe_load(text)
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"expected a mapping, got {text!r}")
        return value
    out: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        if "=" not in part:
            raise argparse.ArgumentTypeError(f"expected key=value in {part!r}")
        key, raw = part.split("=", 1)
        out[key.strip()] = yaml.safe_load(raw)
    return out


def _parse_dev(text: str) -> tuple[str, Any]:
    """``--dev key=value``: a config field by its name (dashes or underscores), value as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("-").replace("-", "_")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if key not in _field_table():
        raise argparse.ArgumentTypeError(f"unknown setting {key!r}")
    return key, yaml.safe_load(raw) if raw.strip() else None


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (the full usage of ~100 flags would bury it)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(prog: str = "miles train") -> argparse.ArgumentParser:
    # allow_abbrev=False: a passthrough --sglang-X must never be read as an abbreviation.
    parser = _Parser(prog=prog, description="Run asynchronous RL (see README.md).", allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file of flag values (flags override it)")
    parser.add_argument("--dev", "--engine-dev", dest="dev", action="append", default=argparse.SUPPRESS, metavar="KEY=VALUE",
                        type=_parse_dev, help="set a developer setting (a config field that is not a flag, "
                        "e.g. decode_attention_chunk=512); repeatable")
    for name, owners in _field_table().items():
        if name in DEV_FIELDS:
            continue
        section, info = owners[0]
        where = ", ".join(s for s, _ in owners)
        text = next((t for s, _ in owners if (t := field_comments(SECTIONS[s]).get(name))), None)
        add_field_flag(parser, name, info, field_help(text, _default(info), where), aliases=ALIASES.get(name, ()))
    return parser


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Each field of a config struct → its source comment (at the end of its line, or the
    comment lines just above it): the flag's ``--help`` text, kept where the field is."""
    try:
        lines = inspect.getsource(cls).splitlines()[1:]
    except (OSError, TypeError):  # no source (a frozen install): the help says type and default only
        return {}
    out: dict[str, str] = {}
    above: list[str] = []
    for line in lines:
        text = line.strip()
        if text.startswith(("def ", "@", "class ")):
            break  # the fields come first
        if text.startswith("#"):
            note = text.lstrip("#").strip()
            if re.match(r"-{3,}\s", note):  # a "--- section ---" divider titles a group, not a field
                above = []
            else:
                above.append(note)
            continue
        field = re.match(r"(\w+)\s*:[^#]*?(?:#\s*(.*))?$", text)
        if field and not text.startswith(('"', "'")):
            comment = field.group(2) or " ".join(above)
            if comment:
                out[field.group(1)] = comment
        above = []
    return out


def _flatten_yaml(data: Any, path: Path) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of flag names to values")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                flat[str(sub_key).lstrip("-").replace("-", "_")] = sub_value
        else:
            flat[name] = value
    return flat


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: malformed YAML: {exc}") from exc
    return _flatten_yaml(data, path)


def resolve(values: dict[str, Any], *, check: bool = True) -> MilesConfig:
    """Build and validate a MilesConfig from flat ``field_name → value`` overrides.

    ``check=False`` skips the cross-field and filesystem rules (``miles.validation``), for
    tests and tools that build partial configs; types and choices are always validated.
    """
    table = _field_table()
    unknown = sorted(k for k in values if k not in table)
    if unknown:
        raise ConfigError(f"unknown option(s): {', '.join(_flag(k) for k in unknown)}")
    from miles.algorithms.config import AlgorithmConfigError, resolve_correction
    from miles.scheduler.staleness import check_staleness

    if isinstance(values.get("max_staleness"), str):  # a flag's text or a YAML word: "2", "inf", "unbounded"
        try:
            values = {**values, "max_staleness": check_staleness(values["max_staleness"])}
        except ValueError as exc:
            raise ConfigError(f"--max-staleness: {exc}") from None

    try:
        values = resolve_correction(values, str(values.get("mode", _default(table["mode"][0][1]))))
    except AlgorithmConfigError as exc:
        raise ConfigError(str(exc)) from None
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for name, owners in table.items():
        # A shared field has one value: the user's, or else the first owner's default.
        if name in values:
            value = values[name]
        elif len(owners) > 1:
            value = _default(owners[0][1])
        else:
            continue
        for section, _info in owners:
            sections[section][name] = value
    config = MilesConfig(**{section: build_struct(cls, sections[section], section)
                            for section, cls in SECTIONS.items()})
    if check:
        from miles.validation import check_config

        check_config(config)
    return config


def _explain(exc: msgspec.ValidationError, section: str) -> str:
    text = str(exc)
    # msgspec says "... - at `$.rollout_batch_size`"; name the flag instead.
    if "$." in text:
        field = text.rsplit("$.", 1)[1].rstrip("`").split(".")[0].split("[")[0]
        return f"{_flag(field)}: {text.split(' - at ')[0]}"
    return f"[{section}] {text}"


def parse_args(argv: Sequence[str] | None = None, prog: str = "miles train") -> MilesConfig:
    """CLI entry: ``--config FILE.yaml`` then flags; raise ConfigError on any problem."""
    parser = build_parser(prog)
    ns, extra = parser.parse_known_args(argv)
    passthrough, unknown = split_passthrough(extra)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    values: dict[str, Any] = {}
    if ns.config:
        values.update(load_yaml(ns.config))
    dev = dict(vars(ns).pop("dev", []))
    values.update({k: v for k, v in vars(ns).items() if k != "config"})
    values.update(dev)
    if passthrough:
        merged = dict(values.get(PASSTHROUGH_FIELD) or {})
        merged.update(passthrough)
        values[PASSTHROUGH_FIELD] = merged
    return resolve(values)


# ``--sglang-<server-flag> [value]`` options are SGLang's own launch flags: they are passed
# through to the server verbatim (as slime does), collected into this field.
PASSTHROUGH_PREFIX = "--sglang-"
PASSTHROUGH_FIELD = "sglang_server_args"


def split_passthrough(extra: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """Split leftover argv into SGLang passthrough flags and truly unknown arguments."""
    passthrough: dict[str, Any] = {}
    unknown: list[str] = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        if arg.startswith(PASSTHROUGH_PREFIX) and PASSTHROUGH_FIELD in _field_table():
            key, _, inline = arg[len(PASSTHROUGH_PREFIX):].partition("=")
            if inline:
                passthrough[key] = yaml.safe_load(inline)
            elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):
                passthrough[key] = yaml.safe_load(extra[i + 1])
                i += 1
            else:
                passthrough[key] = True
        else:
            unknown.append(arg)
        i += 1
    return passthrough, unknown


class MilesConfig:
    """One struct per section; attribute access by section name (``cfg.rollout.n_samples_per_prompt``)."""

    def __init__(self, **sections: Any) -> None:
        missing = set(SECTIONS) - set(sections)
        if missing:
            raise ConfigError(f"missing sections: {sorted(missing)}")
        self.__dict__.update(sections)

    def __getattr__(self, name: str) -> Any:  # only reached for unknown attributes
        raise AttributeError(f"MilesConfig has no section {name!r}; sections: {list(SECTIONS)}")

    def section(self, name: str) -> Any:
        return self.__dict__[name]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: msgspec.to_builtins(self.__dict__[name]) for name in SECTIONS}

    def to_flat(self) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for values in self.to_dict().values():
            flat.update(values)
        return flat

    def replace(self, **flat: Any) -> MilesConfig:
        """A copy with some fields changed (types validated again)."""
        values = self.to_flat()
        values.update(flat)
        return resolve(values, check=False)

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False), encoding="utf-8")


def default_config(**flat: Any) -> MilesConfig:
    """Defaults plus ``flat`` overrides, without the filesystem checks."""
    return resolve(flat, check=False)
