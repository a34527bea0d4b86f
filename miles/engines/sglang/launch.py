"""Launching an SGLang server: its command line, and the process's life.

``build_launch_command`` turns an SGLangConfig, the model path and the worker's port into
``python -m sglang.launch_server --model-path … --host … --port … --weight-version … [flags]``,
the passthrough ``sglang_server_args`` last so they override miles' own choices (as slime
passes ``--sglang-*`` through). Values render as SGLang's argparse reads them: ``True`` →
bare flag, ``False``/``None`` → omitted, lists → repeated values, dicts → JSON.

``ServerProcess`` starts the command in its own process group (SGLang forks scheduler and
detokenizer processes) with output to a log file, and stops the whole group on ``stop``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from miles.engines.sglang.config import SGLangConfig
from miles.utils.net import free_port

DEFAULT_COMMAND = ("-m", "sglang.launch_server")


def flag_name(key: str) -> str:
    """'mem_fraction_static' / '--mem-fraction-static' → 'mem-fraction-static'."""
    return key.lstrip("-").replace("_", "-")


def render_flags(args: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + flag_name(key)
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def server_port(config: SGLangConfig, index: int) -> int:
    return free_port(config.sglang_host) if config.sglang_port == 0 else config.sglang_port + index


def build_launch_command(config: SGLangConfig, *, model_path: str, port: int, weight_version: int,
                         seed: int | None = None) -> tuple[list[str], str]:
    """(argv, base URL) of the server to launch; passthrough flags override ours."""
    args: dict[str, Any] = {
        "model-path": model_path,
        "host": config.sglang_host,
        "port": port,
        "weight-version": str(weight_version),
    }
    if seed is not None:
        args["random-seed"] = seed
    for key, value in config.sglang_server_args.items():
        args[flag_name(key)] = value
    prefix = list(config.sglang_launch_command) or [sys.executable, *DEFAULT_COMMAND]
    if len(prefix) == 1 and " " in prefix[0]:  # one shell-quoted string from the command line
        prefix = shlex.split(prefix[0])
    host = str(args["host"])
    url_host = f"[{host}]" if ":" in host else host
    return [*prefix, *render_flags(args)], f"http://{url_host}:{args['port']}"


class ServerProcess:
    """One launched server; ``stop`` ends its whole process group."""

    def __init__(self, argv: list[str], *, log_path: str | Path | None = None) -> None:
        if argv[1:3] == list(DEFAULT_COMMAND) and importlib.util.find_spec("sglang") is None:
            raise ImportError("launching SGLang needs the sglang package: pip install 'miles[sglang]' "
                              "(or connect to running servers with --sglang-urls)")
        self.argv = argv
        self._own_log = log_path is None  # a temporary log goes when the server stops
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="miles-sglang-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        self._terminate(timeout_s)
        if self._own_log:
            self.log_path.unlink(missing_ok=True)

    def _terminate(self, timeout_s: float) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # our own child's group (start_new_session)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
