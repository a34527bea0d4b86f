"""The real megatron-core GPTModel on the CPU (world size 1, gloo): names, HF load → export,
logits and log-probs against the embedded model, vocab-parallel log-softmax, routing replay,
and load errors. megatron-core's forward puts RoPE tables on ``torch.cuda.current_device()``;
``cuda_on_cpu.install`` points that at the CPU for this module."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install miles[megatron])")

from miles.models import CausalLM, CheckpointError, save_pretrained, tiny_config, token_logprobs  # noqa: E402
from miles.trainers.batching import build_batch  # noqa: E402
from miles.trainers.logprobs import full_routing, linear_logprobs  # noqa: E402
from miles.trainers.logprobs import response_logprobs as embedded_logprobs  # noqa: E402
from miles.trainers.megatron.config import MegatronConfig  # noqa: E402
from miles.trainers.megatron.convert import param_specs  # noqa: E402
from miles.trainers.megatron.mapping import padded_vocab_size  # noqa: E402
from miles.trainers.megatron.sequence import (  # noqa: E402
    make_micro_batch,
    replay_targets,
    response_logprobs,
    vocab_parallel_logprobs,
)
from miles.trainers.megatron.weights import HFReader, export_hf, load_hf, mapping_getter  # noqa: E402
from tests.unit.trainers.conftest import random_groups  # noqa: E402
from tests.unit.trainers.megatron import cuda_on_cpu  # noqa: E402

MCFG = MegatronConfig(moe_token_dispatcher_type="allgather")  # alltoall builds CUDA streams


@pytest.fixture(scope="module")
def layout():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from miles.trainers.megatron.distributed import free_port, init_parallel

    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "current_device", lambda: cuda_on_cpu.CPU)
    started = not dist.is_initialized()
    for key, value in dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        mp.setenv(key, value)
    yield init_parallel(MCFG, device="cpu", seed=0)
    ps.destroy_model_parallel()
    if started:
        dist.destroy_process_group()
    mp.undo()


def _models(layout, moe: bool = False, **overrides):
    from miles.trainers.megatron.model import build_gpt, naming_for

    torch.manual_seed(0)
    cfg = tiny_config(moe=moe, initializer_range=0.1, **overrides)
    ref = CausalLM(cfg).eval()
    gpt = build_gpt(cfg, MCFG, dtype=torch.float32, device="cpu")
    padded = padded_vocab_size(cfg.vocab_size, MCFG.make_vocab_size_divisible_by, 1)
    load_hf(gpt, cfg, mapping_getter(ref.state_dict()), layout, naming_for(gpt.miles_impl), padded)
    return cfg, ref, gpt


def _hidden(gpt, mb):
    from miles.trainers.megatron.model import hidden_states_only

    with hidden_states_only(gpt):
        return gpt(mb.input_ids, mb.position_ids, None)


def _hf(ref: CausalLM) -> dict[str, torch.Tensor]:
    state = ref.state_dict()
    if ref.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


@pytest.mark.parametrize("variant", ["dense", "tied", "moe"])
def test_names_and_load_export_round_trip(layout, variant: str) -> None:
    from miles.trainers.megatron.model import naming_for

    cfg, ref, gpt = _models(layout, moe=variant == "moe", tie_word_embeddings=variant == "tied")
    names = {n for n, _ in gpt.named_parameters()}
    assert names == {s.name for s in param_specs(cfg, naming_for(gpt.miles_impl))}
    assert gpt.embedding.word_embeddings.weight.shape[0] == 384  # 288 padded to a multiple of 128
    out = dict(export_hf(gpt, cfg, layout, naming_for(gpt.miles_impl)))
    hf = _hf(ref)
    assert set(out) == set(hf) and all(torch.equal(out[k], hf[k]) for k in hf)
    bf16 = dict(export_hf(gpt, cfg, layout, naming_for(gpt.miles_impl), dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())


@pytest.mark.parametrize("moe", [False, True])
def test_logits_and_logprobs_match_the_embedded_model(layout, moe: bool) -> None:
    from miles.trainers.megatron.model import output_weight

    cfg, ref, gpt = _models(layout, moe=moe)
    tb = build_batch([t for g in random_groups() for t in g], device="cpu", vocab_size=cfg.vocab_size)
    mb = make_micro_batch(tb, list(range(tb.size)), layout)
    with torch.no_grad():
        logits = gpt(mb.input_ids, mb.position_ids, None)[..., : cfg.vocab_size]
        want = ref(tb.input_ids).logits
        assert (logits - want).abs().max() < 1e-5
        logp, ent = response_logprobs(_hidden(gpt, mb), output_weight(gpt), mb, temperature=0.7,
                                      vocab_size=cfg.vocab_size, layout=layout, grp={}, entropy="metric")
        ref_logp, ref_ent = embedded_logprobs(ref, tb, temperature=0.7, dtype=torch.float32, entropy="metric")
    assert (logp - ref_logp).abs().max() < 1e-5 and (ent - ref_ent).abs().max() < 1e-4


def test_vocab_parallel_logprobs_match_fused_and_mask_padding() -> None:
    torch.manual_seed(0)
    M, H, V, padded = 12, 16, 50, 64
    h = torch.randn(M, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(padded, H, dtype=torch.float64)
    w[V:] = 5.0  # padding rows with large logits must not count
    w.requires_grad_(True)
    tgt = torch.randint(0, V, (M,))
    lp, ent = vocab_parallel_logprobs(h, w, tgt, temperature=0.8, vocab_size=V, entropy="grad")
    ref_lsm = torch.log_softmax((h @ w[:V].T) / 0.8, dim=-1)  # float64, like the inputs
    ref_lp = ref_lsm.gather(1, tgt[:, None]).squeeze(1)
    assert torch.allclose(ref_lp.float(), token_logprobs(h.detach() @ w[:V].detach().T, tgt, 0.8), atol=1e-5)
    ref_ent = -(ref_lsm.exp() * ref_lsm).sum(-1)
    assert torch.allclose(lp, ref_lp) and torch.allclose(ent, ref_ent)
    fused, _ = linear_logprobs(h, w[:V], tgt, temperature=0.8)
    assert torch.allclose(lp, fused)
    g1 = torch.autograd.grad((lp * torch.arange(M)).sum() + ent.sum(), (h, w))
    g2 = torch.autograd.grad((ref_lp * torch.arange(M)).sum() + ref_ent.sum(), (h, w))
    assert all(torch.allclose(a, b) for a, b in zip(g1, g2))
    assert torch.count_nonzero(g1[1][V:]) == 0


def _routed(cfg, tb, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.num_experts_per_tok]
                        for _ in range(tb.routing.numel() // cfg.num_experts_per_tok)]).view_as(tb.routing)


@pytest.mark.parametrize("fallback", [False, True])
def test_routing_replay_matches_the_embedded_replay(layout, fallback: bool) -> None:
    from miles.trainers.megatron.model import output_weight
    from miles.trainers.megatron.replay import RoutingReplay

    cfg, ref, gpt = _models(layout, moe=True)
    replay = RoutingReplay(gpt, cfg.moe_layers, force_fallback=fallback)
    trajs = [t for g in random_groups() for t in g]
    for t in trajs:
        t.routed_experts = [[[0, 1]] * len(cfg.moe_layers) for _ in t.response_tokens]
    tb = build_batch(trajs, device="cpu", vocab_size=cfg.vocab_size,
                     routing_shape=(len(cfg.moe_layers), cfg.num_experts_per_tok))
    tb.routing = _routed(cfg, tb)
    mb = make_micro_batch(tb, list(range(tb.size)), layout)

    def megatron_logp(with_replay: bool) -> torch.Tensor:
        if with_replay:
            replay.set(*replay_targets(mb, len(cfg.moe_layers), cfg.num_experts_per_tok))
        try:
            logp, _ = response_logprobs(_hidden(gpt, mb), output_weight(gpt), mb, temperature=1.0,
                                        vocab_size=cfg.vocab_size, layout=layout, grp={})
        finally:
            replay.clear()
        return logp

    with torch.no_grad():
        own, replayed = megatron_logp(False), megatron_logp(True)
        want, _ = embedded_logprobs(ref, tb, temperature=1.0, dtype=torch.float32,
                                    routing=full_routing(ref, tb, torch.float32))
        plain, _ = embedded_logprobs(ref, tb, temperature=1.0, dtype=torch.float32)
    assert (replayed - want).abs().max() < 1e-5
    assert (own - plain).abs().max() < 1e-5
    assert (replayed - own).abs().max() > 1e-3  # the replay changed the routing


def test_routing_replay_keeps_the_router_gradient(layout) -> None:
    from miles.trainers.megatron.model import output_weight
    from miles.trainers.megatron.replay import RoutingReplay

    cfg, _, gpt = _models(layout, moe=True)
    replay = RoutingReplay(gpt, cfg.moe_layers)
    trajs = [t for g in random_groups() for t in g]
    for t in trajs:
        t.routed_experts = [[[0, 1]] * len(cfg.moe_layers) for _ in t.response_tokens]
    tb = build_batch(trajs, device="cpu", vocab_size=cfg.vocab_size,
                     routing_shape=(len(cfg.moe_layers), cfg.num_experts_per_tok))
    mb = make_micro_batch(tb, list(range(tb.size)), layout)
    replay.set(*replay_targets(mb, len(cfg.moe_layers), cfg.num_experts_per_tok))
    logp, _ = response_logprobs(_hidden(gpt, mb), output_weight(gpt), mb, temperature=1.0,
                                vocab_size=cfg.vocab_size, layout=layout, grp={})
    replay.clear()
    logp.sum().backward()
    router = gpt.decoder.layers[0].mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_load_errors_name_the_tensor_and_change_nothing(layout) -> None:
    from miles.trainers.megatron.model import naming_for

    cfg, ref, gpt = _models(layout)
    before = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    state = {k: torch.zeros_like(v) for k, v in ref.state_dict().items()}
    bad_shape = dict(state, **{"model.layers.1.mlp.down_proj.weight": torch.zeros(3, 3)})
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    padded = padded_vocab_size(cfg.vocab_size, 128, 1)
    with pytest.raises(CheckpointError, match="linear_fc2"):
        load_hf(gpt, cfg, mapping_getter(bad_shape), layout, naming_for(gpt.miles_impl), padded)
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_hf(gpt, cfg, mapping_getter(missing), layout, naming_for(gpt.miles_impl), padded)
    assert all(torch.equal(p, before[n]) for n, p in gpt.named_parameters())


def test_loads_a_safetensors_checkpoint(layout, tmp_path) -> None:
    from miles.trainers.megatron.model import build_gpt, naming_for

    cfg, ref, _ = _models(layout, moe=True)
    save_pretrained(ref, tmp_path)
    gpt = build_gpt(cfg, MCFG, dtype=torch.float32, device="cpu")
    load_hf(gpt, cfg, HFReader(tmp_path), layout, naming_for(gpt.miles_impl), 384)
    out = dict(export_hf(gpt, cfg, layout, naming_for(gpt.miles_impl)))
    assert all(torch.equal(out[k], v) for k, v in _hf(copy.deepcopy(ref)).items())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        HFReader(tmp_path / "nowhere")
