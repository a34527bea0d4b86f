"""The compiled trainer's warm-up in a process of its own, so the first steps need not wait
for it (``compile_warmup="background"``, the CUDA default; ``--dev compile_warmup=...``).

Why a process: the warm-up is compile work (dynamo tracing, AOTAutograd, inductor, Triton),
tens of seconds for a Qwen3-0.6B shape, and the trainer's first step waited for all of it. Run
in a thread beside eager steps it held the GIL (the eager steps ran slower than compiled ones),
was not done after several steps, and the two threads shared one model's lazily grown buffers
(a device assert). A child process shares neither the GIL nor the model.

What carries over is torch's on-disk caches: inductor's FX graph cache, AOTAutograd's cache
and Triton's kernel cache (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``; by default per
user under /tmp and ~/.triton, so a second run finds them too). The child builds the same
decoder layer shapes with one layer (the layers share their graphs: ``compilation``), random
weights (graphs do not depend on values), a vocabulary of at most ``CHILD_VOCAB`` (so it fits
in a few GB beside a colocated engine; the two LM-head kernels, compiled for the vocabulary,
are then left to the switch), and runs the same warm-up ladder. The trainer
steps eagerly meanwhile; at the start of the first step after the child exits it compiles
its own layers and runs the warm-up again, which now hits the caches (seconds, not tens),
so the switch happens between steps, never inside one. A child that fails leaves the
trainer to compile in-process at that point, as ``compile_warmup="inline"`` does at start.

The child runs ``main([SPEC.json])``: the spec holds the model,
trainer and algorithm configs; the child writes ``{"warmup_s": ...}`` to ``SPEC.json.out``.
"""

from __future__ import annotations

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
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from miles.trainers.embedded import EmbeddedTrainer

log = logging.getLogger(__name__)

CHILD_VOCAB = 8192  # the child's vocabulary at most (its LM-head kernels then compile at the switch)


class BackgroundCompile:
    """The warm-up child of one trainer: started at construction, polled between steps."""

    def __init__(self, trainer: EmbeddedTrainer) -> None:
        import miles

        self.dir = Path(tempfile.mkdtemp(prefix="miles-compile-"))
        spec = {"model": msgspec.to_builtins(trainer.model.config),
                "trainer": msgspec.to_builtins(trainer.config),
                "algo": msgspec.to_builtins(trainer.algo)}
        self.spec = self.dir / "spec.json"
        self.spec.write_text(json.dumps(spec))
        self.log_path = self.dir / "warmup.log"
        env = dict(os.environ)
        root = str(Path(miles.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # little memory beside an engine
        self.started = time.monotonic()
        with open(self.log_path, "wb") as out:
            entry = "import sys; from miles.trainers.compile_cache import main; main(sys.argv[1:])"
            self.proc = subprocess.Popen([sys.executable, "-c", entry, str(self.spec)],
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
        log.warning("background compile warm-up failed (rc %s); compiling in-process instead:\n%s",
                    self.proc.returncode, tail)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _exit_with_parent() -> None:
    """The child dies with its trainer (a killed Ray actor runs no atexit hooks)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def warm_in_child(spec: dict[str, Any]) -> float:
    """Build a one-layer model of the spec's shape and run the compiled trainer's warm-up;
    returns its seconds."""
    import torch

    from miles.algorithms import AlgorithmConfig
    from miles.models import CausalLM
    from miles.models.config import ModelConfig
    from miles.trainers.config import TrainerConfig
    from miles.trainers.embedded import EmbeddedTrainer

    # One layer and a small vocabulary: the decoder layers' graphs see hidden states only.
    # The full vocabulary's LM head ([tokens, vocab] logits and their gradient at the warm-up's
    # largest micro-batch, gigabytes for a 152k vocabulary) need not fit beside a colocated engine.
    vocab = min(spec["model"]["vocab_size"], CHILD_VOCAB)
    model_cfg = msgspec.convert({**spec["model"], "num_hidden_layers": 1, "vocab_size": vocab}, ModelConfig)
    trainer_cfg = msgspec.convert({**spec["trainer"], "compile": True, "compile_warmup": "inline"}, TrainerConfig)
    # the warm-up reads the entropy mode only; no reference model is built for it
    algo = msgspec.convert({**spec["algo"], "kl_coef": 0.0, "reward_kl_coef": 0.0}, AlgorithmConfig)
    with torch.device(trainer_cfg.device):
        model = CausalLM(model_cfg)
    start = time.monotonic()
    EmbeddedTrainer(model, config=trainer_cfg, algo=algo)  # compiles and warms up at construction
    return time.monotonic() - start


def main(argv: list[str]) -> None:
    _exit_with_parent()
    os.nice(10)  # its compile workers inherit it: the engines' own first compiles and the eager steps come first
    spec_path = Path(argv[0])
    seconds = warm_in_child(json.loads(spec_path.read_text()))
    Path(f"{spec_path}.out").write_text(json.dumps({"warmup_s": seconds}))

