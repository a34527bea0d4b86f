"""The engine's compiled step functions, made ready without holding its first rollouts
(``EngineConfig.compile_warmup="background"``, the CUDA default).

Why: the compiled layer functions (``miles.models.fused.compile_fast_path``) must be warmed
for every shape class before they serve (``ModelRunner.warm_compiled``), and that compile —
dynamo, AOTAutograd, inductor, Triton — held the engine's first rollout for tens of seconds on
a Qwen3-0.6B shape: the first trained step waited for it.

How: the engine is built on the eager step functions (the same fused projections and pure
functions, uncompiled; CUDA graphs are captured over them as over the compiled ones) and
serves at once. Meanwhile a child process (``miles.utils.compile_child``, as the trainer's
warm-up uses) builds an engine of the same shape with one decoder layer (the
layers share their graphs) and a small vocabulary (the compiled functions never see the LM
head), and runs the same warm-up, filling torch's on-disk caches (inductor's FX graph cache,
AOTAutograd's, Triton's) without sharing the engine's GIL or memory. Once the child is done,
the stepping thread switches between two steps: it puts the compiled functions in place,
warms them up (dynamo traces each shape class again; its graphs come from the caches), and
drops the CUDA graphs (captured again as the engine meets each bucket or idles). It switches
where that costs least: when no request is running (a sync run's train step, a pause), else
at a weight commit, else after ``SWITCH_AFTER_STEPS`` steps. A warm-up that fails at the
switch leaves the eager functions in place (with a log line); a child that fails leaves the
switch to compile from scratch in-process, as ``compile_warmup="inline"`` does at start.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from miles.utils.compile_child import CHILD_VOCAB, BackgroundCompile

if TYPE_CHECKING:
    from miles.engines.embedded import EmbeddedEngine

log = logging.getLogger(__name__)

SWITCH_AFTER_STEPS = 256  # steps after the child is done before an engine never idle switches anyway
POLL_S = 0.5  # how often an idle engine looks at the child
ENTRY = "miles.engines.warmup:warm_in_child"  # what the child runs


def child_spec(engine: EmbeddedEngine) -> dict[str, Any]:
    return {"model": msgspec.to_builtins(engine.model.config), "engine": msgspec.to_builtins(engine.config)}


def warm_in_child(spec: dict[str, Any]) -> float:
    """Build a one-layer engine of the spec's shape (compile on, inline) and warm its compiled
    step functions as the stepping thread would; returns the warm-up's seconds."""
    from miles.engines.config import EngineConfig
    from miles.engines.embedded import EmbeddedEngine, step_mode
    from miles.models.config import ModelConfig
    from miles.models.model import CausalLM

    vocab = min(spec["model"]["vocab_size"], CHILD_VOCAB)
    model_cfg = msgspec.convert({**spec["model"], "num_hidden_layers": 1, "vocab_size": vocab}, ModelConfig)
    # two slots: the warm-up's rows; no graphs and no memory plan (graphs are not cached on disk)
    cfg = msgspec.convert({**spec["engine"], "compile": True, "compile_warmup": "inline", "cuda_graphs": False,
                           "engine_mem_fraction": None, "max_batch_size": 2}, EngineConfig)
    with torch.device(cfg.device):
        model = CausalLM(model_cfg)
    engine = EmbeddedEngine(model, config=cfg)
    start = time.monotonic()
    with step_mode(engine.runner.device):
        engine.runner.warm_compiled()
    return time.monotonic() - start


class CompileSwitch:
    """The child of one engine and the switch it leads to. Polled by the stepping thread only."""

    def __init__(self, engine: EmbeddedEngine, child: Any = None) -> None:
        self.engine = engine
        self.started = time.perf_counter()
        self.child = child if child is not None else BackgroundCompile(child_spec(engine), ENTRY)
        self.steps_waited = 0  # steps taken since the child was done (not idle, no commit)
        self.stats: dict[str, float] = {"engine/compiled": 0.0}

    def due(self, *, idle: bool, committed: bool) -> bool:
        """Whether to switch now (between two steps). Never blocks."""
        if not self.child.done():
            return False
        if idle or committed:
            return True
        self.steps_waited += 1
        return self.steps_waited >= SWITCH_AFTER_STEPS

    def switch(self) -> bool:
        """Compiled step functions in place of the eager ones, warmed up, and the CUDA graphs
        captured over the eager ones dropped (captured again when a bucket is met, or while
        the engine is idle); the eager ones stay where the warm-up fails. Returns whether
        the engine now runs compiled. Call between steps, with the step in flight drained."""
        from miles.models.fused import FastPath, compile_fast_path

        from miles.engines.sampling import compile_counter_uniform

        engine = self.engine
        runner = engine.runner
        ok_child = self.child.ok()  # logs a failed child's tail
        start = time.perf_counter()
        engine.model.fuse_projections(compile_fast_path())  # already fused: the step functions only
        compiled = runner.warm_compiled()
        if not compiled:
            engine.model.fuse_projections(FastPath())
            log.warning("the engine's compiled step functions failed their warm-up at the switch; "
                        "it keeps serving with the eager ones")
        else:
            compile_counter_uniform(runner.device)
        warm_s = time.perf_counter() - start
        if compiled:  # captured over the eager functions: again when met, or while idle
            engine.offloader.drop_graphs()
        seconds = time.perf_counter() - start
        self.stats = {
            "engine/compiled": float(compiled),
            "engine/compile_switch_s": seconds,  # the stepping thread's pause
            "engine/compile_switch_warm_s": warm_s,
            "engine/compile_child_s": self.child.seconds,  # the child's wall time, launch to exit
            "engine/compile_child_ok": float(ok_child),
            "engine/eager_serve_s": start - self.started,  # engine built to the switch
            "engine/compiled_from_version": float(engine.version),
            "engine/compiled_after_decode_steps": float(engine.stats_.counters["decode_steps"]),
        }
        log.warning("engine switched to %s step functions after %.1f s eager (child %.1f s, %s): "
                    "%.1f s warm-up, %.1f s in all",
                    "compiled" if compiled else "eager", start - self.started, self.child.seconds,
                    "ok" if ok_child else "failed", warm_s, seconds)
        return compiled

    def stop(self) -> None:
        self.child.stop()
