"""`miles train` bad input: one clear message naming the problem, exit 2, no finished-looking
outputs. These fail before Ray starts, so they are unit tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.cli import main
from miles.config import ConfigError, default_config, parse_args


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from miles.models import CausalLM, build_tiny_tokenizer, save_pretrained, tiny_config

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(CausalLM(tiny_config()), path, tokenizer=build_tiny_tokenizer())
    return path


@pytest.fixture()
def files(tmp_path, ckpt) -> dict[str, Path]:
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"input": f"q{i}", "label": "a"}) for i in range(4)) + "\n")
    rm = tmp_path / "rm.py"
    rm.write_text("def reward(s):\n    return 1.0\n")
    return {"data": data, "rm": rm, "ckpt": ckpt, "out": tmp_path / "out"}


def _argv(f: dict[str, Path], *extra: str) -> list[str]:
    return ["train", "--hf-checkpoint", str(f["ckpt"]), "--prompt-data", str(f["data"]),
            "--custom-rm-path", f"{f['rm']}:reward", "--output-dir", str(f["out"]), *extra]


def _fails(argv: list[str], capsys, needle: str) -> str:
    code: object
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err, err
    return err


def test_missing_checkpoint(files, capsys, tmp_path) -> None:
    argv = _argv(files)
    argv[argv.index("--hf-checkpoint") + 1] = str(tmp_path / "nope")
    _fails(argv, capsys, "--hf-checkpoint")
    assert not files["out"].exists()


def test_missing_data_file(files, capsys, tmp_path) -> None:
    argv = _argv(files)
    argv[argv.index("--prompt-data") + 1] = str(tmp_path / "missing.jsonl")
    _fails(argv, capsys, "--prompt-data")
    assert not files["out"].exists()


def test_jsonl_without_input_key(files, capsys) -> None:
    files["data"].write_text(json.dumps({"question": "x"}) + "\n")
    err = _fails(_argv(files), capsys, "missing_input_key")
    assert "no usable rows" in err
    assert not (files["out"] / "summary.json").exists()


def test_bad_line_fails_with_flag(files, capsys) -> None:
    files["data"].write_text(json.dumps({"input": "ok"}) + "\n{not json\n")
    _fails(_argv(files, "--on-bad-data", "fail"), capsys, ":2: malformed_json")


def test_malformed_yaml(files, capsys, tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout-batch-size: [1, 2\n")
    _fails(_argv(files, "--config", str(bad)), capsys, "malformed YAML")


def test_unknown_flag(files, capsys) -> None:
    _fails(_argv(files, "--no-such-flag", "3"), capsys, "--no-such-flag")


def test_unknown_yaml_key(files, capsys, tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout-batchsize: 3\n")
    _fails(_argv(files, "--config", str(cfg)), capsys, "--rollout-batchsize")


def test_bad_choice_and_type(files, capsys) -> None:
    _fails(_argv(files, "--advantage-estimator", "nope"), capsys, "--advantage-estimator")
    _fails(_argv(files, "--rollout-batch-size", "x"), capsys, "--rollout-batch-size")


def test_compile_on_the_cpu_without_a_compiler(files, capsys, monkeypatch) -> None:
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    _fails(_argv(files, "--compile"), capsys, "--compile on the CPU needs a C++ compiler")


def test_incompatible_flags(files, capsys) -> None:
    err = _fails(_argv(files, "--mode", "sync", "--over-sampling-batch-size", "64", "--rollout-batch-size", "32"),
                 capsys, "--partial-rollout")
    assert "invalid configuration" in err
    _fails(_argv(files, "--n-samples-per-prompt", "1"), capsys, "--n-samples-per-prompt >= 2")
    _fails(_argv(files, "--env-path", "examples/agentic/calculator.py:CalculatorEnv", "--use-rollout-routing-replay"),
           capsys, "environment tokens have no recorded routing")
    _fails(_argv(files, "--advantage-estimator", "ppo"), capsys, "no critic yet")
    _fails(_argv(files, "--decode-attention", "triton"), capsys, "--decode-attention triton is a CUDA kernel")
    _fails(_argv(files, "--decode-attention", "flash"), capsys, "choose auto, matmul, sdpa or triton")
    _fails(_argv(files, "--dev", "decode_attention_chunk=100"), capsys, "--decode-attention-chunk 100: 0 (auto) or a power")
    _fails(_argv(files, "--kv-cache-dtype", "int4"), capsys, "--kv-cache-dtype 'int4': choose auto, fp8_e4m3, fp8_e5m2")
    _fails(_argv(files, "--kv-cache-dtype", "fp8_e4m3", "--dev", "cpu_decode_kernel=true"), capsys, "reads a cache in the engine's own dtype")
    _fails(_argv(files, "--kv-cache-dtype", "fp8_e4m3", "--rollout-backend", "sglang"), capsys,
           "--sglang-kv-cache-dtype fp8_e4m3")
    # GPU layouts that Ray could not place (a worker past the placement group's last GPU, or
    # two NCCL ranks on one GPU): refused before anything starts
    _fails(_argv(files, "--actor-num-gpus-per-node", "1"), capsys, "--rollout-num-gpus for the engines' own GPUs")
    _fails(_argv(files, "--rollout-num-gpus", "1"), capsys, "needs the trainer on GPUs too")
    _fails(_argv(files, "--actor-num-gpus-per-node", "2", "--colocate"), capsys, "trains on one GPU in a run")
    _fails(_argv(files, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-rollout-workers", "2"),
           capsys, "takes a GPU of its own")
    _fails(_argv(files, "--rollout-backend", "sglang", "--sglang-launch", "--speculative-algorithm", "eagle"),
           capsys, "--draft-model-path")


def test_bad_lora_settings_fail_before_start(files, capsys) -> None:
    _fails(_argv(files, "--lora-rank", "4", "--lora-target-modules", "qkv_proj"), capsys, "matches no linear layer")
    _fails(_argv(files, "--lora-rank", "100000", "--lora-target-modules", "q_proj"), capsys, "is larger than")
    _fails(_argv(files, "--lora-rank", "4", "--train-backend", "megatron"), capsys, "--lora-rank needs --train-backend embedded")
    _fails(_argv(files, "--offload-train"), capsys, "--offload-train moves the trainer's optimizer state")


def test_yaml_then_flags_precedence(files, tmp_path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout:\n  n-samples-per-prompt: 8\nrollout-max-response-len: 7\nlr: 0.5\n")
    cfg = parse_args(_argv(files, "--config", str(cfg_file), "--lr", "0.25")[1:])
    assert cfg.rollout.n_samples_per_prompt == 8 and cfg.buffer.n_samples_per_prompt == 8
    assert cfg.rollout.rollout_max_response_len == 7
    assert cfg.trainer.lr == 0.25


def test_shared_fields_agree() -> None:
    cfg = default_config(seed=7, max_staleness=3)
    assert cfg.run.seed == cfg.engine.seed == cfg.trainer.seed == 7
    assert cfg.scheduler.max_staleness == cfg.buffer.max_staleness == 3
    assert cfg.engine.dtype == cfg.trainer.dtype
    with pytest.raises(ConfigError, match="--max-staleness"):
        default_config(max_staleness="many")


def test_config_dump_round_trip(tmp_path) -> None:
    cfg = default_config(lr=3e-4, mode="sync", rollout_stop=["\n"])
    cfg.dump(tmp_path / "c.yaml")
    from miles.config import load_yaml, resolve

    again = resolve(load_yaml(tmp_path / "c.yaml"), check=False)
    assert again.to_dict() == cfg.to_dict()


def test_bad_function_path(files, capsys) -> None:
    argv = _argv(files)
    argv[argv.index("--custom-rm-path") + 1] = f"{files['rm']}:nope"
    _fails(argv, capsys, "has no attribute 'nope'")
    assert not files["out"].exists()


def test_deterministic_refuses_the_cpu_kernel(files, capsys) -> None:
    argv = _argv(files, "--mode", "sync", "--deterministic", "--dev", "cpu_decode_kernel=true")
    _fails(argv, capsys, "--deterministic keeps the torch decode path")
    assert not files["out"].exists()


def test_help_describes_every_flag_of_the_main_sections(capsys) -> None:
    """`miles train --help` exits 0 and says what the flags do: the comment at each config
    field (every field of the run, data and rollout sections has one)."""
    from miles.config import _field_table, field_comments
    from miles.config import SECTIONS

    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "which entry of a dict reward to train on" in out and "[rollout, trainer] default: None" in out
    assert "50%%" not in out  # argparse's % escaping does not leak
    table = _field_table()
    for section in ("run", "data", "rollout"):
        missing = [n for n in msgspec_fields(SECTIONS[section]) if not field_comments(SECTIONS[section]).get(n)]
        assert not missing, (section, missing)
    assert len(table) > 100


def msgspec_fields(cls: type) -> list[str]:
    import msgspec

    return [f.name for f in msgspec.structs.fields(cls)]


def test_max_staleness_outside_async_mode_is_noted_not_refused(files) -> None:
    from miles.config import parse_args
    from miles.validation import notes

    def cfg(*extra: str):
        return parse_args(_argv(files, *extra)[1:])  # without the command

    assert notes(cfg("--mode", "sync", "--max-staleness", "2")) == [  # valid: parsed without an error
        "--max-staleness 2 is read only with --mode async; --mode sync trains at η = 0"]
    assert notes(cfg("--mode", "one-step-off", "--max-staleness", "4"))[0].endswith("η = 1")
    assert notes(cfg("--mode", "async", "--max-staleness", "4")) == []
    assert notes(cfg("--mode", "sync")) == []


def test_help_lists_at_most_140_flags_and_quotes_no_timing() -> None:
    """``miles train --help`` is for users: developer settings are reached through ``--dev``,
    and a help line says what a flag does, not how fast it was."""
    import re

    from miles.config import DEV_FIELDS, build_parser

    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) <= 140, f"{len(flags)} flags"
    shown = {a.dest for a in flags}
    assert not shown & DEV_FIELDS
    timing = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}|H200|[0-9] ?(µs|us|ms)\b|[0-9]x faster")
    assert [a.option_strings[0] for a in flags if timing.search(a.help or "")] == []


def test_dev_sets_a_field_that_is_not_a_flag(capsys) -> None:
    from miles.config import build_parser, parse_args

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--decode-attention-chunk", "512"])
    cfg_values = build_parser().parse_args(["--dev", "decode-attention-chunk=512", "--engine-dev", "admit_min=4"])
    assert dict(cfg_values.dev) == {"decode_attention_chunk": 512, "admit_min": 4}
    with pytest.raises(SystemExit):
        parse_args(["--dev", "no_such_setting=1"])
    assert "unknown setting 'no_such_setting'" in capsys.readouterr().err


def test_serve_flags_come_from_its_structs_through_the_train_bridge() -> None:
    """``miles serve``'s flags are its config structs' fields, built by the function that
    builds ``miles train``'s: help from the field's comment, ``--no-`` bools, typed values,
    SGLang's aliases; a developer setting keeps its flag with a terse help line."""
    import msgspec

    from miles.engines import EngineConfig
    from miles.serve import build_parser
    from miles.serving.server import ServeConfig

    by_dest = {a.dest: a for a in build_parser()._actions if a.option_strings}
    for cls in (ServeConfig, EngineConfig):
        for f in msgspec.structs.fields(cls):
            assert f"--{f.name.replace('_', '-')}" in by_dest[f.name].option_strings, f.name
    assert by_dest["port"].help == "0 picks a free port (printed on start) default: 30000"
    assert "--no-keep-kv-cache-on-update" in by_dest["keep_kv_cache_on_update"].option_strings
    assert by_dest["hf_checkpoint"].option_strings == ["--hf-checkpoint", "--model-path"]
    assert by_dest["seed"].option_strings == ["--seed", "--random-seed"]
    assert by_dest["decode_attention_chunk"].help == "(developer setting) default: 0"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--port", "many"])


def test_serve_cross_field_checks_live_with_the_runs(capsys) -> None:
    import re

    from miles.serve import parse_args

    serve, engine, spec, level = parse_args(["--model-path", "ck", "--random-seed", "3", "--max-seq-len", "64",
                                             "--no-keep-kv-cache-on-update"])
    assert (serve.hf_checkpoint, engine.seed, engine.max_seq_len, engine.keep_kv_cache_on_update) == ("ck", 3, 64, False)
    assert not spec.enabled and level == "warning"
    for argv, needle in (
            (["--port", "1"], "--hf-checkpoint (or --model-path) is required"),
            (["--hf-checkpoint", "ck", "--speculative-num-steps", "3"], "--speculative-* flags need --speculative-algorithm"),
            (["--hf-checkpoint", "ck", "--speculative-algorithm", "EAGLE"], "needs --speculative-draft-model-path"),
            # the engine's checks are the run's (miles.validation._engine_problems)
            (["--hf-checkpoint", "ck", "--decode-attention", "bogus"], "--decode-attention 'bogus': choose"),
            (["--hf-checkpoint", "ck", "--deterministic", "--cpu-decode-kernel"], "drop --cpu-decode-kernel")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            parse_args(argv)
    assert main(["serve", "--hf-checkpoint", "ck", "--speculative-num-steps", "3"]) == 2
    assert "miles serve: error: invalid configuration" in capsys.readouterr().err
