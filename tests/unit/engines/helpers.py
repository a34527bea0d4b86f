"""Shared helpers for the embedded-engine tests: tiny float32 models on the CPU.

Weights use std 0.1 (not HF's 0.02) so that next-token distributions are peaked enough for
greedy decoding to be meaningful and far from ties.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import torch

from miles.engines import EmbeddedEngine, EngineConfig
from miles.models import CausalLM, Tokenizer, tiny_config


def make_model(seed: int = 0, **overrides: Any) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(tiny_config(initializer_range=0.1, **overrides)).eval()


def make_engine(model: CausalLM | None = None, tokenizer: Tokenizer | None = None,
                overlap: bool = False, **config: Any) -> EmbeddedEngine:
    """An engine of ``config`` on a tiny model. ``overlap``: the launch-ahead decode schedule
    a CUDA engine runs (``Stepper.overlap``), here on the CPU, so that its bookkeeping (a row
    finished by step k still in step k+1) is tested without a GPU."""
    cfg = EngineConfig(**{"max_batch_size": 8, "max_seq_len": 256, **config})
    engine = EmbeddedEngine(model if model is not None else make_model(), config=cfg, tokenizer=tokenizer)
    engine.stepper.overlap = overlap or engine.stepper.overlap
    return engine


def paced(engine: EmbeddedEngine, seconds: float = 0.001) -> EmbeddedEngine:
    """Make each decode step of ``engine`` take at least ``seconds`` longer. Tests that act in
    mid-generation (abort, pause, a weight update at token k) must not depend on how fast the
    engine decodes: with the CPU decode kernel a tiny model makes 40 tokens in ~4 ms, less
    than one polling interval of such a test."""
    decode = engine.runner.decode

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return decode(*args, **kwargs)

    engine.runner.decode = slow  # type: ignore[method-assign]
    return engine


def run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(torch.randint(5, 260, (length,), generator=g).tolist())
    return out
