"""Several Megatron ranks on the CPU: spawned processes in one gloo group, each building its
shard of the real megatron-core model. HF → sharded load → collective export is exact, and
log-probs (and, for TP, gradients) equal the single-process embedded model, for
TP=2 (dense), EP=2 (MoE, experts split over data-parallel ranks), TP=2 × EP=2 with ETP=1 and
PP=2 (tied embeddings). ``cuda_on_cpu`` points megatron's device placement at the CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install miles[megatron])")

from tests.unit.trainers.megatron.cuda_on_cpu import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

CASES = [  # (name, MegatronConfig kwargs, moe, tied)
    ("tp2_dense", dict(tensor_model_parallel_size=2), False, False),
    ("ep2_moe", dict(expert_model_parallel_size=2, moe_token_dispatcher_type="allgather"), True, False),
    ("tp2_ep2_etp1_moe", dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                              expert_tensor_parallel_size=1, moe_token_dispatcher_type="allgather"), True, False),
    ("pp2_tied", dict(pipeline_model_parallel_size=2), False, True),
]


def _case(name: str, mkw: dict, moe: bool, tied: bool) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from miles.models import CausalLM, tiny_config
    from miles.trainers.batching import build_batch
    from miles.trainers.logprobs import response_logprobs as embedded_logprobs
    from miles.trainers.megatron.config import MegatronConfig
    from miles.trainers.megatron.distributed import groups, init_parallel
    from miles.trainers.megatron.mapping import padded_vocab_size
    from miles.trainers.megatron.model import build_gpt, hidden_states_only, naming_for, output_weight
    from miles.trainers.megatron.sequence import make_micro_batch, response_logprobs
    from miles.trainers.megatron.weights import export_hf, load_hf, mapping_getter
    from tests.unit.trainers.conftest import random_groups

    torch.manual_seed(0)
    cfg = tiny_config(moe=moe, initializer_range=0.1, tie_word_embeddings=tied)
    ref = CausalLM(cfg)
    mcfg = MegatronConfig(**mkw)
    layout = init_parallel(mcfg, device="cpu", seed=0)
    grp = groups()
    try:
        gpt = build_gpt(cfg, mcfg, dtype=torch.float32, device="cpu")
        naming = naming_for(gpt.miles_impl)
        padded = padded_vocab_size(cfg.vocab_size, mcfg.make_vocab_size_divisible_by, layout.tp)
        load_hf(gpt, cfg, mapping_getter(ref.state_dict()), layout, naming, padded)
        out = dict(export_hf(gpt, cfg, layout, naming, grp=grp))
        hf = {k: v for k, v in ref.state_dict().items() if not (tied and k == "lm_head.weight")}
        result: dict[str, Any] = {"exact": set(out) == set(hf) and all(torch.equal(out[k], hf[k]) for k in hf)}
        if layout.pp > 1:
            return result
        if moe and layout.tp > 1:
            gpt.eval()  # megatron refuses MoE + TP training without sequence parallelism
        tb = build_batch([t for g in random_groups() for t in g], device="cpu", vocab_size=cfg.vocab_size)
        mb = make_micro_batch(tb, list(range(tb.size)), layout)
        with hidden_states_only(gpt):
            hidden = gpt(mb.input_ids, mb.position_ids, None)
        logp, _ = response_logprobs(hidden, output_weight(gpt), mb, temperature=0.7, vocab_size=cfg.vocab_size,
                                    layout=layout, grp=grp)
        want, _ = embedded_logprobs(ref, tb, temperature=0.7, dtype=torch.float32)
        result["logp"] = float((logp - want).detach().abs().max())
        (logp * tb.loss_mask).sum().backward()
        (want * tb.loss_mask).sum().backward()
        grad = gpt.decoder.layers[0].self_attention.linear_proj.weight.grad
        ref_grad = ref.model.layers[0].self_attn.o_proj.weight.grad.chunk(layout.tp, dim=1)[layout.tp_rank]
        result["grad"] = float((grad - ref_grad).abs().max())
        return result
    finally:
        ps.destroy_model_parallel()


def _all_cases(rank: int) -> dict[str, dict[str, Any]]:
    from tests.unit.trainers.megatron.cuda_on_cpu import install

    install(full=True)  # tied embeddings across stages call .cuda()
    return {name: _case(name, mkw, moe, tied) for name, mkw, moe, tied in CASES}


def test_sharded_load_export_and_logprobs_on_two_ranks() -> None:
    results = run_ranks(_all_cases, 2, timeout=400)
    for rank, per_case in enumerate(results):
        for name, r in per_case.items():
            assert r["exact"], (rank, name)
            if "logp" in r:
                assert r["logp"] < 1e-5 and r["grad"] < 1e-5, (rank, name, r)
