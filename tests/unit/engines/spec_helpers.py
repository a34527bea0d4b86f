"""Helpers for the speculative-decoding engine tests."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import torch

from miles.engines import EmbeddedEngine, EngineConfig
from miles.engines.spec import SpeculativeConfig
from miles.models import CausalLM, token_logprobs
from miles.models.draft import build_draft
from miles.types import GenerateOutput, GenerateRequest

from .helpers import make_model


def noisy_copy(model: CausalLM, scale: float, seed: int = 0) -> CausalLM:
    """The policy with noise on every weight: a draft that is right about half the time."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return draft


def make_draft(kind: str, policy: CausalLM, seed: int = 1) -> Any:
    if kind == "draft":
        return noisy_copy(policy, 0.05, seed)
    return build_draft("eagle", policy.config, seed=seed)


def spec_engine(policy: CausalLM, kind: str = "draft", *, draft: Any = None, mode: str = "rejection", k: int = 3,
                adaptive: bool = False, spec: dict | None = None, **config: Any) -> EmbeddedEngine:
    cfg = EngineConfig(**{"max_batch_size": 8, "max_seq_len": 256, **config})
    sc = SpeculativeConfig(speculative_algorithm=kind, speculative_num_steps=k, speculative_sampling=mode,
                           speculative_adaptive=adaptive, **(spec or {}))
    draft = draft if draft is not None else make_draft(kind, policy)
    return EmbeddedEngine(copy.deepcopy(policy), config=cfg, draft=copy.deepcopy(draft), speculative=sc)


def generate_all(engine: EmbeddedEngine, requests: list[GenerateRequest]) -> list[GenerateOutput]:
    async def go():
        outs = await asyncio.gather(*(engine.generate(r) for r in requests))
        await engine.close()
        return outs

    return asyncio.run(go())


def full_logprobs(model: CausalLM, prompt: list[int], out: GenerateOutput, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([prompt + out.output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    t = temperature if temperature > 1e-6 else 1.0
    return token_logprobs(logits, torch.tensor(out.output_ids), t)


__all__ = ["full_logprobs", "generate_all", "make_draft", "make_model", "noisy_copy", "spec_engine"]
