"""The one-pass Triton sampler (``miles.kernels.sampling`` through
``miles.engines.sampling.fused_sample``) against the torch draw it replaces, and an engine
with ``fused_sampling=True`` against one with torch sampling. Runs on CUDA, or on the CPU in
triton's interpreter (tests/conftest.py sets TRITON_INTERPRET); skipped without triton."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.engines import EmbeddedEngine, EngineConfig
from miles.engines.sampling import SamplingBatch, fused_failure, fused_sample, row_key, sample
from miles.kernels import sampling as kernel
from miles.models import CausalLM, tiny_config
from miles.types import GenerateRequest, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(kernel.triton is None or not kernel.available(DEVICE),
                                reason="needs triton (CUDA, or its CPU interpreter with numpy < 2.4)")


def _batch(temps: list[float], seeds: list[int | None], position: int = 5) -> SamplingBatch:
    keys = [None if s is None else row_key(s, position + i) for i, s in enumerate(seeds)]
    return SamplingBatch(list(temps), [1.0] * len(temps), [-1] * len(temps), keys)


@pytest.mark.parametrize("V", [7, kernel.BLOCK + 3, kernel.CHUNK, 2 * kernel.CHUNK + 5])
def test_matches_the_torch_draw(V: int) -> None:
    """Tokens equal and log-probs within float32 sums of the torch path, for greedy, tempered
    and plain rows, vocabularies inside one block, at a chunk's edge and across chunks."""
    g = torch.Generator().manual_seed(V)
    temps = [1.0, 0.5, 0.0, 2.0, 1e-7, 0.9]
    logits = (torch.randn(len(temps), V, generator=g) * 3).to(DEVICE)
    batch = _batch(temps, list(range(len(temps))))
    want_tok, want_lp = sample(logits, batch, None)
    tok, out = fused_sample(logits, batch, None)
    assert tok.dtype == torch.int64 and out.shape == (3, len(temps)) and out.dtype == torch.float64
    assert tok.tolist() == want_tok.tolist()
    assert out[0].tolist() == [float(t) for t in want_tok.tolist()]
    torch.testing.assert_close(out[1].float(), want_lp, atol=2e-5, rtol=1e-5)
    assert out[2].tolist() == [1.0] * len(temps)


@pytest.mark.skipif(DEVICE != "cuda", reason="a 152k vocabulary a row is slow in triton's interpreter")
def test_a_near_certain_token_is_always_drawn_from_a_large_vocabulary() -> None:
    """test_sampling's check of the hashed uniforms, through the kernel: one token 40 nats above
    the rest of a 152k vocabulary wins every draw, seeded or not (uniforms that reached 1.0
    gave ~0.9% of such draws to a random token)."""
    V, rows = 151936, 1200
    logits = torch.zeros(rows, V, device=DEVICE)
    logits[:, 7] = 40.0
    for seeds in (list(range(rows)), [None] * rows):
        tok, out = fused_sample(logits, _batch([1.0] * rows, seeds), torch.Generator(DEVICE).manual_seed(3))
        assert (tok == 7).all(), tok[tok != 7].tolist()
        assert out[1].abs().max() < 1e-6


def test_reads_bf16_logits_as_their_float32_upcast() -> None:
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 3000, generator=g) * 3).to(DEVICE, torch.bfloat16)
    batch = _batch([1.0, 0.7, 0.0, 1.3], [3, 4, 5, 6])
    want_tok, want_lp = sample(logits.float(), batch, None)
    tok, out = fused_sample(logits, batch, None)
    assert tok.tolist() == want_tok.tolist()
    torch.testing.assert_close(out[1].float(), want_lp, atol=2e-5, rtol=1e-5)


def test_flags_non_finite_rows_and_keeps_tokens_in_range() -> None:
    logits = torch.zeros(3, 500).to(DEVICE)
    logits[0, 17] = float("nan")
    logits[1, 499] = float("inf")
    tok, out = fused_sample(logits, _batch([1.0, 1.0, 1.0], [1, 2, 3]), None)
    assert out[2].tolist() == [0.0, 0.0, 1.0]
    assert all(0 <= t < 500 for t in tok.tolist())


def test_ties_go_to_the_lowest_index_across_chunks() -> None:
    """Greedy over a vocabulary whose maximum repeats in two chunks: argmax's first index."""
    V = 2 * kernel.CHUNK + 10
    logits = torch.zeros(1, V)
    logits[0, kernel.CHUNK + 3] = 5.0
    logits[0, 2 * kernel.CHUNK + 1] = 5.0
    tok, _ = fused_sample(logits.to(DEVICE), _batch([0.0], [None]), None)
    assert tok.tolist() == [kernel.CHUNK + 3]


def test_ties_within_a_chunk_go_to_the_lowest_index_whichever_lane_holds_it() -> None:
    """Per-lane running maxima: a tie between a later lane's first block and an earlier
    lane's later block goes to the lower index, as argmax's."""
    V = kernel.CHUNK
    logits = torch.zeros(2, V)
    logits[0, [7, kernel.BLOCK + 1]] = 5.0  # lane 7 in the first block, lane 1 in the second
    logits[1, [kernel.BLOCK + 9, 2 * kernel.BLOCK + 3]] = 5.0
    tok, _ = fused_sample(logits.to(DEVICE), _batch([0.0, 0.0], [None, None]), None)
    assert tok.tolist() == [7, kernel.BLOCK + 9]


@pytest.mark.parametrize("chunk", [kernel.CHUNK, kernel.WIDE_CHUNK])
def test_lane_and_block_reductions_draw_alike(chunk: int) -> None:
    """The kernel's two reduction forms (``lanes``), at either chunk of the default launch:
    the same tokens and finiteness flags, log-probs within float32 sums of each other."""
    g = torch.Generator().manual_seed(12)
    V = 2 * chunk + 5
    logits = (torch.randn(6, V, generator=g) * 3).to(torch.bfloat16)  # bf16: many ties
    logits[2, 100] = float("nan")
    temps = torch.tensor([1.0, 0.7, 0.0, 1.0, 2.0, 1e-7]).to(DEVICE)
    keys = torch.tensor([row_key(i, 40 + i) for i in range(6)]).to(DEVICE)
    (tok_a, out_a), (tok_b, out_b) = (kernel.sample(logits.to(DEVICE), temps, keys, chunk=chunk, lanes=lanes)
                                      for lanes in (True, False))
    assert tok_a.tolist() == tok_b.tolist()
    assert out_a[2].tolist() == out_b[2].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    keep = [0, 1, 3, 4, 5]
    torch.testing.assert_close(out_a[1][keep], out_b[1][keep], atol=1e-5, rtol=1e-6)


def test_unseeded_rows_follow_the_generator_and_the_distribution() -> None:
    """Rows without a seed hash a key from the generator: the same generator state gives the
    same tokens, and the draws follow softmax(logits / T) (a chi-square-sized check)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    T = 0.8
    logits = (probs.log() * T).to(DEVICE).expand(400, 4).contiguous()
    batch = _batch([T] * 400, [None] * 400)
    draw = [fused_sample(logits, batch, torch.Generator(DEVICE).manual_seed(7))[0].tolist() for _ in range(2)]
    assert draw[0] == draw[1]
    counts = torch.bincount(torch.tensor(draw[0]), minlength=4).float()
    expected = probs * 400
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (counts.tolist(), chi2)  # p ≈ 0.001 at 3 degrees of freedom


def test_truncating_batches_take_the_torch_path() -> None:
    batch = SamplingBatch([1.0], [0.9], [-1], [row_key(1, 1)])
    assert fused_sample(torch.zeros(1, 10).to(DEVICE), batch, None) is None


def test_the_probe_passes_here() -> None:
    assert fused_failure(DEVICE) is None


def test_engine_with_the_fused_sampler_draws_what_the_torch_sampler_draws() -> None:
    """Seeded requests through a whole engine: the same tokens with and without the fused
    sampler (float32, tiny model), and log-probs to float32 sums."""
    torch.manual_seed(0)
    model = CausalLM(tiny_config(vocab_size=300)).eval()
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]

    async def run(fused: bool) -> list:
        engine = EmbeddedEngine(model, config=EngineConfig(
            max_batch_size=4, max_seq_len=64, device=DEVICE, dtype="float32", fused_sampling=fused,
            cpu_decode_kernel=False, compile=False))
        engine.start()
        try:
            assert engine.stats()["engine/fused_sampling"] == float(fused)
            return await asyncio.gather(*(engine.generate(GenerateRequest(
                rid=f"r{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=12, temperature=t, seed=i,
                                                                  ignore_eos=True)))
                for i, (p, t) in enumerate(zip(prompts, [1.0, 0.7, 0.0]))))
        finally:
            await engine.close()

    fused, plain = asyncio.run(run(True)), asyncio.run(run(False))
    for a, b in zip(fused, plain):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=5e-5, rtol=1e-5)
