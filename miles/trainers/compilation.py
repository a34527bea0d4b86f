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
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from miles.types import Trajectory

if TYPE_CHECKING:
    from miles.trainers.embedded import EmbeddedTrainer

RECOMPILE_LIMIT = 32  # graphs dynamo may build per compiled function (its default: 8)
WARM_MIN, WARM_STEP = 12, 2  # the warm-up's shortest rows, and the factor between sizes
WARM_DEFAULT_TOKENS = 16384  # the warm-up's largest micro-batch without max_tokens_per_micro_batch


def compile_layers(model: nn.Module) -> None:
    """Each decoder layer under ``torch.compile`` (dynamic shapes; the layers share graphs).
    Dynamo's default of 8 graphs per function is close to what the warm-up builds (7 for
    the attention block on the CPU: grad modes × size regimes × one row). Past that limit,
    new shapes run eager for the rest of the process, so the limit is raised."""
    from miles.models.layers import attention_out_of_graphs

    attention_out_of_graphs()
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    for layer in model.model.layers:
        layer.compile(dynamic=True)


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


def warm_up(trainer: EmbeddedTrainer) -> None:
    """Run every warm-up shape through the trainer's layers: the log-prob pass without
    gradients, and each planned micro-batch's forward and backward. The gradients are thrown
    away; the weights do not change."""
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
        batch = trainer._batch(trajs, check_versions=False)
        trainer._no_grad_logprobs(trainer.model, batch)
        for plan in batch.plan(range(batch.size), trainer.config):
            logp, entropy = trainer._forward(trainer.model, batch.select(plan), trainer._entropy_mode())
            grad_entropy = entropy is not None and entropy.requires_grad
            (logp.sum() + (entropy.sum() if grad_entropy else 0.0)).backward()
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
