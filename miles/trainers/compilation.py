"""The compiled trainer: its decoder layers under ``torch.compile``, warmed up for every
micro-batch shape class before the first step, so that no step compiles in the middle of a run.

Why a warm-up at all: a recompile in the middle of a run is a train step of seconds (tens of
seconds on a GPU for one row's first micro-batch). Dynamo specializes a dimension of size 1, so the
first micro-batch of one row (a long trajectory alone, a leftover) recompiled the layers,
forward and backward, whenever it came. Inductor also guards its kernels on size thresholds
of the shape it compiled with. On the CPU these are ``4·rows·tokens ≤ 4096`` and the like,
and they come in pairs (``2·n ≤ 4096``, ``n > 4096``). A warm-up with short rows therefore
left a recompile to the first long micro-batch. A ×4 ladder stepped over the band between
a pair, which left one recompile to the first RL step whose micro-batch fell in it. That
is reproduced on the CPU (the warm-up's tests), and without the ladder it happens once in
the middle of most runs of a GPU sweep.

So the warm-up climbs from short rows to the largest micro-batch the plan makes, ×2 at a
time, with one row and with several. Any band at least ×2 wide holds a point of the
ladder. It runs the forward with and without gradients, since grad mode is guarded too.
Smallest first: largest-first built more graphs than dynamo's per-function limit on the
CPU. After the warm-up, a recompile logs the guard that failed.

The warm-up runs in a thread of its own (``WarmUp``, the default): compiling the ladder takes
longer than a run's first steps, so the trainer is ready at once and steps eagerly until the
compiled layers are warm, then switches to them between two calls. Each layer's call goes
through a gate that picks the compiled form in the warm-up's thread and, once it is done, in
every thread. Dynamo's frame hook is per thread, so the eager steps never trace. The warm-up's
backward asks autograd for the gradient of the first trainable weight only, which runs every
layer's compiled backward without accumulating into any ``.grad`` the steps are using.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from miles.types import Trajectory

if TYPE_CHECKING:
    from miles.trainers.embedded import EmbeddedTrainer

RECOMPILE_LIMIT = 32  # graphs dynamo may build per compiled function (its default: 8)
WARM_MIN, WARM_STEP = 12, 2  # the warm-up's shortest rows, and the factor between sizes
WARM_DEFAULT_TOKENS = 16384  # the warm-up's largest micro-batch without max_tokens_per_micro_batch


class WarmUp:
    """The compiled layers' warm-up, in a thread of its own (``background``) or inline.

    ``use_compiled()`` says whether the calling thread runs the compiled form now: always
    inline; in the background, in the warm-up's own thread, and in every thread once it is done.
    """

    def __init__(self, background: bool) -> None:
        self.background = background
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # the warm-up's wall time, once done

    def use_compiled(self) -> bool:
        return not self.background or self.done.is_set() or threading.current_thread() is self.thread

    def start(self, trainer: EmbeddedTrainer) -> None:
        if not self.background:
            self._run(trainer)
            return
        self.thread = threading.Thread(target=self._run, args=(trainer,), name="miles-compile-warm-up", daemon=True)
        self.thread.start()

    def _run(self, trainer: EmbeddedTrainer) -> None:
        t0 = time.monotonic()
        try:
            warm_up(trainer, isolated=self.background)
            log_recompiles()
        except BaseException as exc:  # re-raised by the next step (``check``), in the trainer's thread
            if not self.background:
                raise
            self.error = exc
            print(f"miles: the trainer's compile warm-up failed: {exc!r}", file=sys.stderr, flush=True)
        finally:
            self.seconds = time.monotonic() - t0
            if self.error is None:
                self.done.set()

    def check(self) -> None:
        """Raise what the background warm-up raised (the trainer would meet it compiling)."""
        if self.error is not None:
            raise RuntimeError("the trainer's torch.compile warm-up failed (--no-compile runs eagerly)") from self.error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the warm-up is done (benchmarks and tests); False on a timeout."""
        return self.done.wait(timeout)


def compile_layers(model: nn.Module, warm: WarmUp | None = None) -> None:
    """Each decoder layer under ``torch.compile`` (dynamic shapes; the layers share graphs),
    called through ``warm``'s gate when it warms up in the background.
    Dynamo's default of 8 graphs per function is close to what the warm-up builds (7 for
    the attention block on the CPU: grad modes × size regimes × one row). Past that limit,
    new shapes run eager for the rest of the process, so the limit is raised."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    for layer in model.model.layers:
        if warm is None or not warm.background:
            layer.compile(dynamic=True)
        else:  # what Module.compile does, behind the gate
            layer._compiled_call_impl = _gated(layer._call_impl, torch.compile(layer._call_impl, dynamic=True), warm)


def _gated(eager: Any, compiled: Any, warm: WarmUp) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        return compiled(*args, **kwargs) if warm.use_compiled() else eager(*args, **kwargs)

    return call


def warm_shapes(context: int, max_tokens: int | None) -> list[tuple[int, int]]:
    """(rows, tokens per row) of the warm-up's micro-batches: for micro-batch sizes
    (rows × tokens) ×2 apart up to ``max_tokens`` (the largest the plan makes), one row (as
    long as the model's ``context`` allows) and several."""
    top = max_tokens or WARM_DEFAULT_TOKENS
    sizes, n = [], 2 * WARM_MIN
    while n < top:
        sizes.append(n)
        n *= WARM_STEP
    sizes.append(max(top, 2 * WARM_MIN))
    shapes: list[tuple[int, int]] = []
    for n in sizes:
        rows = max(2, -(-n // context))
        shapes.append((rows, max(n // rows, 3)))
        if n <= top:
            shapes.append((1, max(min(n, context), 3)))
    return list(dict.fromkeys(shapes))


def warm_up(trainer: EmbeddedTrainer, isolated: bool = False) -> None:
    """Run every warm-up shape through the trainer's layers: the log-prob pass without
    gradients, and each planned micro-batch's forward and backward. The gradients are thrown
    away; the weights do not change. ``isolated`` (beside running steps): the backward
    reaches no ``.grad``, and the allocator's cache is left alone."""
    first = next((p for p in trainer.model.parameters() if p.requires_grad), None)
    cfg = trainer.model.config
    replay = trainer.config.use_rollout_routing_replay and trainer.is_moe
    g = torch.Generator().manual_seed(0)
    for rows, length in trainer.warm_shapes():
        trajs = []
        for i in range(rows):
            t = Trajectory(id=f"warm{i}", prompt_id="warm", group_id="warm",
                           prompt_tokens=torch.randint(cfg.vocab_size, (2,), generator=g).tolist())
            n = length - 2
            t.append(torch.randint(cfg.vocab_size, (n,), generator=g).tolist(), [0.0] * n, trainer.version,
                     kind="model")
            if replay:  # the replayed-routing path compiles apart: give it routes to replay
                k, experts = cfg.num_experts_per_tok, cfg.num_experts
                t.routed_experts = [[[(j + e) % experts for e in range(k)] for _ in cfg.moe_layers]
                                    for j in range(n)]
            trajs.append(t)
        batch = trainer._build(trajs, check_versions=False)
        trainer._no_grad_logprobs(trainer.model, batch)
        for plan in batch.plan(range(batch.size), trainer.config):
            logp, entropy = trainer._forward(trainer.model, batch.select(plan), trainer._entropy_mode())
            grad_entropy = entropy is not None and entropy.requires_grad
            loss = logp.sum() + (entropy.sum() if grad_entropy else 0.0)
            if not isolated:
                loss.backward()
            elif first is not None and loss.requires_grad:
                torch.autograd.grad(loss, [first], allow_unused=True)
    if isolated:
        return
    trainer.optimizer.zero_grad(set_to_none=True)
    if trainer.device.type == "cuda":  # the largest micro-batch's blocks: back to a colocated engine
        torch.cuda.empty_cache()


def log_recompiles() -> None:
    """From here on, a recompile says which guard failed (stderr, which Ray forwards to the
    driver). The warm-up covers every shape class it knows of, so a recompile in the middle
    of a run is a class it missed, and the failed guard names it. This is left alone when
    the user chose torch's logs (TORCH_LOGS)."""
    if not os.environ.get("TORCH_LOGS"):
        torch._logging.set_logs(recompiles=True)
