"""A world of one starts its process group even when its port was taken in the meantime."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]

CHILD = """
import os, torch.distributed as dist
from miles.trainers.megatron.distributed import init_process_group
init_process_group("cpu")
print("ok", dist.get_world_size(), os.environ["MASTER_PORT"])
"""


def _run(env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full.pop(key, None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", CHILD], env=full, capture_output=True, text=True, timeout=120)


def test_world_of_one_moves_off_a_taken_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _run({"MASTER_PORT": str(port), "WORLD_SIZE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    ok, world, used = done.stdout.split()[-3:]
    assert (ok, world) == ("ok", "1") and int(used) != port


def test_larger_world_keeps_its_port_and_fails_clearly() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _run({"MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": "0"})
    assert done.returncode != 0
    assert "EADDRINUSE" in done.stderr or "address already in use" in done.stderr
