"""A compile warm-up in a child process: the process, its spec, its polling, its failure report.

Used by the trainer (``miles.trainers.compile_cache``) and by the rollout engine
(``miles.engines.warmup``), whose first steps run eagerly while a child compiles the same
shapes on a one-layer model. What carries over to the parent is torch's on-disk caches
(inductor's FX graph cache, AOTAutograd's, Triton's: ``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR``, inherited by the child), so the parent's own compile later finds its
graphs there. A process, not a thread: the compile shares neither the parent's GIL nor its
model's buffers.

The child runs ``main([SPEC.json])``: the spec names its warm-up function (``"entry"``,
``"pkg.mod:fn"``, called with the spec, returning its seconds) and holds what that function
needs; the child writes ``{"warmup_s": ...}`` to ``SPEC.json.out``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The children's vocabulary at most: the compiled functions that see it (a trainer's LM-head
# kernels) compile at the switch; it keeps a child's logits small beside a colocated engine.
CHILD_VOCAB = 8192


class BackgroundCompile:
    """One warm-up child: started at construction, polled (never blocking) between steps."""

    def __init__(self, spec: dict[str, Any], entry: str) -> None:
        import miles

        self.dir = Path(tempfile.mkdtemp(prefix="miles-compile-"))
        self.spec = self.dir / "spec.json"
        self.spec.write_text(json.dumps({**spec, "entry": entry}))
        self.log_path = self.dir / "warmup.log"
        env = dict(os.environ)
        root = str(Path(miles.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # little memory beside an engine
        self.started = time.monotonic()
        with open(self.log_path, "wb") as out:
            code = "import sys; from miles.utils.compile_child import main; main(sys.argv[1:])"
            self.proc = subprocess.Popen([sys.executable, "-c", code, str(self.spec)],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.seconds = 0.0  # the child's wall time, launch to exit
        self.warmup_s = 0.0  # its warm-up alone (without imports and CUDA start)

    def done(self) -> bool:
        """Whether the child has exited (it never blocks)."""
        if self.proc.poll() is None:
            return False
        if not self.seconds:
            self.seconds = time.monotonic() - self.started
        return True

    def ok(self) -> bool:
        """The child exited cleanly (call after ``done``); else its log's tail goes to the log."""
        if self.proc.returncode == 0:
            out = Path(f"{self.spec}.out")
            if out.exists():
                self.warmup_s = float(json.loads(out.read_text()).get("warmup_s", 0.0))
            shutil.rmtree(self.dir, ignore_errors=True)  # a failed child's log stays for its user
            return True
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        log.warning("background compile warm-up failed (rc %s, log %s); compiling in-process instead:\n%s",
                    self.proc.returncode, self.log_path, tail)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _exit_with_parent() -> None:
    """The child dies with its parent (a killed Ray actor runs no atexit hooks)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> None:
    _exit_with_parent()
    os.nice(10)  # its compile workers inherit it: the parent's own first compiles and eager steps come first
    spec_path = Path(argv[0])
    spec = json.loads(spec_path.read_text())
    module, _, name = spec["entry"].partition(":")
    seconds = getattr(importlib.import_module(module), name)(spec)
    Path(f"{spec_path}.out").write_text(json.dumps({"warmup_s": seconds}))
