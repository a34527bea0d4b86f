"""``miles serve``: run the embedded engine as an HTTP server speaking SGLang's protocol.

    miles serve --hf-checkpoint DIR [--host 127.0.0.1] [--port 30000] [--max-batch-size N]
                [--max-seq-len N] [--device cpu|cuda] [--dtype auto] [--weight-version V] ...

Flags are ``ServeConfig``'s and ``EngineConfig``'s field names (``_`` → ``-``; built as ``miles
train``'s are, by ``miles.config.add_struct_flags``; cross-field checks in
``miles.validation.check_serve``), plus the
SGLang spellings ``--model-path`` (= ``--hf-checkpoint``) and ``--random-seed`` (= ``--seed``),
so a launcher that starts ``python -m sglang.launch_server --model-path … --port …`` can
start ``python -m miles serve`` with the same flags — SGLang's speculative flags included
(``--speculative-algorithm EAGLE|STANDALONE --speculative-draft-model-path DIR
--speculative-num-steps K``: the embedded engine's speculative decoding with that draft).
``--port 0`` picks a free port. Once
the server accepts connections it prints ``miles serve: listening on http://HOST:PORT``.
SIGINT/SIGTERM abort in-flight requests and stop the server. docs/sglang.md has the
endpoints and a deployment recipe.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from miles.config import add_struct_flags, build_struct
from miles.engines import EngineConfig
from miles.engines.spec import SpeculativeConfig
from miles.serving.server import ServeConfig, Server
from miles.utils import aio

_ALIASES = {"hf_checkpoint": ["--model-path"], "seed": ["--random-seed"]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles serve", description=__doc__.split("\n\n")[0])
    add_struct_flags(parser.add_argument_group("server"), ServeConfig, aliases=_ALIASES)
    add_struct_flags(parser.add_argument_group("engine"), EngineConfig, aliases=_ALIASES)
    parser.add_argument("--log-level", default="warning", help="logging level (default: warning)")
    # SGLang's R3 switch, which miles adds to launched servers under routing replay: routed
    # experts are always available here (for MoE models), so it is accepted and changes nothing.
    parser.add_argument("--enable-return-routed-experts", action="store_true", help=argparse.SUPPRESS)
    spec = parser.add_argument_group("speculative decoding (SGLang's flags)")
    for flag, tp, text in (
            ("speculative-algorithm", str, "EAGLE / EAGLE3 / NEXTN / MTP (a head on the policy's hidden states) "
                                           "or STANDALONE (a small LM); needs --speculative-draft-model-path"),
            ("speculative-draft-model-path", str, "the draft's checkpoint directory (miles' draft format)"),
            ("speculative-num-steps", int, "draft tokens per round"),
            ("speculative-num-draft-tokens", int, "tokens verified per round (chain drafts: steps + 1)"),
            ("speculative-eagle-topk", int, "1 (tree drafts are not implemented)")):
        spec.add_argument(f"--{flag}", dest=flag, type=tp, default=argparse.SUPPRESS, help=text)
    return parser


def parse_args(argv: Sequence[str]) -> tuple[ServeConfig, EngineConfig, SpeculativeConfig, str]:
    """The command line as configs, validated (``miles.validation.check_serve``); a problem
    is a ``ValueError`` (``ConfigError``) naming the flag."""
    from miles.engines.spec.config import from_sglang_args
    from miles.validation import check_serve

    ns = vars(build_parser().parse_args(list(argv)))
    log_level = ns.pop("log_level")
    ns.pop("enable_return_routed_experts", None)
    sglang_spec = {k: ns.pop(k) for k in list(ns) if k.startswith("speculative-")}
    spec = build_struct(SpeculativeConfig, from_sglang_args(sglang_spec), "speculative")
    serve_names = {f.name for f in msgspec.structs.fields(ServeConfig)}
    serve = build_struct(ServeConfig, {k: v for k, v in ns.items() if k in serve_names}, "server")
    engine = build_struct(EngineConfig, {k: v for k, v in ns.items() if k not in serve_names}, "engine")
    check_serve(serve, engine, spec, speculative_flags=sorted(sglang_spec))
    return serve, engine, spec, log_level


def _draft(spec: SpeculativeConfig) -> Any:
    from miles.models.draft import draft_kind, load_draft

    draft = load_draft(spec.draft_model_path, dtype=torch.float32)
    if draft_kind(draft) != spec.speculative_algorithm:
        raise ValueError(f"--speculative-draft-model-path {spec.draft_model_path} holds a {draft_kind(draft)!r} "
                         f"draft, but --speculative-algorithm asks for {spec.speculative_algorithm!r}")
    return draft


def build_server(serve: ServeConfig, engine_cfg: EngineConfig, *, explicit_seq_len: bool,
                 speculative: SpeculativeConfig | None = None) -> Server:
    """Load the checkpoint (and its tokenizer, if it has one) and start the engine."""
    from miles.engines import EmbeddedEngine
    from miles.models import load_config, load_pretrained, load_tokenizer

    path = Path(serve.hf_checkpoint)
    max_pos = load_config(path).max_position_embeddings
    if not explicit_seq_len:  # the default context, capped by what the model supports
        engine_cfg = msgspec.structs.replace(engine_cfg, max_seq_len=min(engine_cfg.max_seq_len, max_pos))
    tokenizer = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    model = load_pretrained(path, device=engine_cfg.device, dtype=engine_cfg.torch_dtype())
    spec_on = speculative is not None and speculative.enabled
    engine = EmbeddedEngine(model, config=engine_cfg, tokenizer=tokenizer, version=serve.weight_version,
                            draft=_draft(speculative) if spec_on else None, speculative=speculative if spec_on else None)
    engine.start()
    return Server(engine, config=serve, tokenizer=tokenizer)


async def run(server: Server, *, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM), then shut down cleanly."""
    from aiohttp import web

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, server.config.host, server.config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(f"miles serve: listening on http://{host}:{port} (model {server.config.hf_checkpoint}, "
              f"weight_version {server.engine.version})", flush=True)
        await stop.wait()
    finally:
        await server.close()
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        serve, engine_cfg, spec, log_level = parse_args(argv)
    except ValueError as exc:  # flag values the dataclasses refuse: one line, status 2
        print(f"miles serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    explicit = any(a == "--max-seq-len" or a.startswith("--max-seq-len=") for a in argv)
    try:
        server = build_server(serve, engine_cfg, explicit_seq_len=explicit, speculative=spec)
    except (OSError, ValueError) as exc:  # missing/bad checkpoint or flags: one line, status 2
        print(f"miles serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        aio.run(run(server))  # on uvloop where installed
    except OSError as exc:  # e.g. the port is taken
        print(f"miles serve: error: {exc}", file=sys.stderr)
        return 2
    return 0
