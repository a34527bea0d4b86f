"""A policy whose next-token law a small draft can learn from a few thousand tokens, and
trajectories sampled from it by the embedded engine."""

from __future__ import annotations

import asyncio
import copy

import torch

from miles.engines import EmbeddedEngine, EngineConfig
from miles.models import CausalLM, tiny_config
from miles.types import GenerateRequest, SamplingParams, Status, Trajectory


def bigram_policy(seed: int, sharpness: float = 4.0) -> CausalLM:
    """Large embeddings and small layers: the next token depends mostly on the last one (a
    random bigram table, peaked by ``sharpness``), with a little context on top."""
    g = torch.Generator().manual_seed(seed)
    model = CausalLM(tiny_config())
    model.reset_parameters(g)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0, generator=g)
        model.lm_head.weight.normal_(0.0, sharpness / 8, generator=g)
    return model.eval()


def sample_trajectories(policy: CausalLM, n: int, seed: int, new_tokens: int = 32,
                        version: int = 0) -> list[Trajectory]:
    engine = EmbeddedEngine(copy.deepcopy(policy), config=EngineConfig(max_batch_size=32, max_seq_len=128),
                            version=version)
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(5, 260, (6,), generator=g).tolist() for _ in range(n)]

    async def go():
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(
            rid=str(i), input_ids=p, sampling=SamplingParams(max_new_tokens=new_tokens, seed=seed * 100_000 + i,
                                                             ignore_eos=True))) for i, p in enumerate(ps)))
        await engine.close()
        return outs

    trajs = []
    for i, (p, o) in enumerate(zip(ps, asyncio.run(go()))):
        t = Trajectory(id=f"{seed}-{i}", prompt_id=str(i), group_id=f"{seed}-{i // 4}", index_in_group=i % 4,
                       prompt_tokens=p, status=Status.COMPLETED)
        t.append(o.output_ids, o.logprobs, o.versions)
        trajs.append(t)
    return trajs
