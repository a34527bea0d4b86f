"""The CPU decode kernel (miles.kernels.cpu_decode) against the torch decode path: same
logits, hidden states and KV-cache writes to float32 round-off, for each attention variant
the model supports; refusals of bad steps; the cases where the engine keeps torch ops."""

from __future__ import annotations

import asyncio
import copy
import ctypes
import os
import time

import pytest
import torch

from miles.engines import EngineConfig
from miles.engines.runner import ModelRunner
from miles.kernels import cpu_decode
from miles.models import CausalLM, token_logprobs
from miles.types import GenerateRequest, SamplingParams

from .helpers import make_engine, make_model


@pytest.fixture(autouse=True)
def _compiler() -> None:
    """The kernel needs a C compiler; a machine without one decodes with torch ops (tested
    below). With a compiler, a kernel that fails to build fails these tests."""
    try:
        cpu_decode._compiler()
    except cpu_decode.KernelUnavailable as exc:
        pytest.skip(str(exc))


VARIANTS = {
    "qwen3 (q/k-norm)": {},
    "qwen2 (q/k/v bias)": dict(model_type="qwen2", attention_bias=True, o_proj_bias=False),
    "llama (q/k/v/o bias, MHA)": dict(model_type="llama", attention_bias=True, num_key_value_heads=4),
    "head_dim 24, GQA 6/2": dict(num_attention_heads=6, num_key_value_heads=2, head_dim=24),
    "head_dim 64, 1 KV head, tied": dict(num_key_value_heads=1, head_dim=64, tie_word_embeddings=True),
}


# The kernel as the engine builds it, and without its AVX-512 paths (the portable loops that
# machines without AVX-512 run; on such a machine both builds are the same).
BUILDS = {"native": tuple(cpu_decode.FLAGS), "no-avx512": (*cpu_decode.FLAGS, "-mno-avx512f")}


def _runners(model: CausalLM, slots: int = 4, length: int = 96,
             flags: tuple[str, ...] | None = None) -> tuple[ModelRunner, ModelRunner]:
    model = model.requires_grad_(False)
    model.fuse_projections()
    fast = ModelRunner(model, EngineConfig(max_batch_size=slots, max_seq_len=length))
    ref = ModelRunner(model, EngineConfig(max_batch_size=slots, max_seq_len=length, cpu_decode_kernel=False))
    assert fast.cpu_kernel is not None and ref.cpu_kernel is None
    if flags is not None:
        fast.cpu_kernel = cpu_decode.CpuDecoder(model, fast.cache, slots, lib=cpu_decode.build(flags))
    return fast, ref


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kernel_matches_the_torch_decode_step(variant: str, build: str) -> None:
    model = make_model(seed=3, **VARIANTS[variant])
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    fast, ref = _runners(model, flags=BUILDS[build])
    seqs = [[5, 9, 11], [7] * 20, [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40] * 33]  # blocks of 16 and tails
    for runner in (fast, ref):
        runner.prefill(list(range(4)), seqs, logits=False)
    positions = [len(s) for s in seqs]
    tokens = [17, 2, 250, 33]
    for step in range(12):
        got, want = fast.decode(tokens, positions), ref.decode(tokens, positions)
        torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got.hidden, want.hidden, atol=2e-5, rtol=1e-5)
        tokens = want.logits.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    assert fast.kv_read < ref.kv_read  # each row read up to its own position only
    for a, b in ((fast.cache.k, ref.cache.k), (fast.cache.v, ref.cache.v)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_rows_split_between_threads_give_the_same_step_bit_for_bit() -> None:
    """Past PARALLEL_WORK the rows' attention is split between threads, balanced by their
    lengths; each row is computed by the same code whoever runs it, so logits, hidden states
    and cache writes are those of one thread exactly."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)  # the workspace is sized for the threads torch has at build time
    try:
        model = make_model(seed=5, num_attention_heads=16, num_key_value_heads=4, head_dim=64)
        fast, _ = _runners(model, slots=8, length=1000)
        kernel = fast.cpu_kernel
        assert kernel.threads == 2
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(5, 250, (m,), generator=g).tolist() for m in (900, 3, 620, 17, 512, 90, 300, 2)]
        fast.prefill(list(range(8)), seqs, logits=False)
        cfg = model.config
        assert 2 * sum(len(s) + 1 for s in seqs) * cfg.num_attention_heads * cfg.head_dim >= 1 << 22  # split
        positions, tokens = [len(s) for s in seqs], [11, 12, 13, 14, 15, 16, 17, 18]
        k, v = fast.cache.k.clone(), fast.cache.v.clone()
        outs = {}
        for threads in (1, 2):
            fast.cache.k.copy_(k)
            fast.cache.v.copy_(v)
            kernel.threads = threads
            logits, hidden = kernel.decode(tokens, positions)
            outs[threads] = logits, hidden, fast.cache.k.clone(), fast.cache.v.clone()
        for a, b in zip(outs[1], outs[2]):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(saved)


def test_the_kernel_reads_updated_weights_in_place() -> None:
    """Engine weight updates copy into the parameters: the kernel's pointers see them."""
    model = make_model(seed=4)
    fast, ref = _runners(model)
    for runner in (fast, ref):
        runner.prefill([0], [[5, 6, 7]], logits=False)
    before = fast.decode([8], [3]).logits.clone()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    got, want = fast.decode([8], [3]), ref.decode([8], [3])
    torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(got.logits, before)


def test_bad_steps_are_refused_and_write_nothing() -> None:
    fast, _ = _runners(make_model(seed=5), slots=2, length=16)
    fast.prefill([0, 1], [[5, 6], [7]], logits=False)
    k, v = fast.cache.k.clone(), fast.cache.v.clone()
    vocab = fast.model.config.vocab_size
    with pytest.raises(ValueError, match="token id outside the vocabulary"):
        fast.cpu_kernel.decode([3, vocab], [2, 1])
    with pytest.raises(ValueError, match="position outside the KV cache"):
        fast.cpu_kernel.decode([3, 4], [2, 16])
    with pytest.raises(ValueError, match="position outside"):
        fast.cpu_kernel.decode([3, 4, 5], [2, 1, 0])  # more rows than cache slots
    assert fast.cache.k.equal(k) and fast.cache.v.equal(v)


def test_engine_uses_the_kernel_where_it_applies() -> None:
    engine = make_engine(make_model())
    assert engine.runner.cpu_kernel is not None and engine.stats()["engine/cpu_decode_kernel"] == 1.0
    assert make_engine(make_model(), cpu_decode_kernel=False).stats()["engine/cpu_decode_kernel"] == 0.0
    # torch ops where the kernel does not apply or the user asked for a torch attention
    assert make_engine(make_model(moe=True)).runner.cpu_kernel is None
    assert make_engine(make_model(), dtype="bfloat16").runner.cpu_kernel is None
    assert make_engine(make_model(), decode_attention="sdpa").runner.cpu_kernel is None
    assert make_engine(make_model(), deterministic=True).runner.cpu_kernel is None
    assert make_engine(make_model(), cpu_decode_kernel=False).runner.cpu_kernel is None
    with pytest.raises(ValueError, match="cpu_decode_kernel=True"):
        make_engine(make_model(moe=True), cpu_decode_kernel=True)


async def _generate(engine, prompts: list[list[int]], new: int = 8) -> list:
    outs = await asyncio.gather(*(engine.generate(GenerateRequest(
        rid=str(i), input_ids=p, sampling=SamplingParams(max_new_tokens=new, seed=i, ignore_eos=True)))
        for i, p in enumerate(prompts)))
    await engine.close()
    return outs


def test_engine_logprobs_match_the_full_forward() -> None:
    """Sampled tokens' log-probs from kernel steps equal a full forward's to < 1e-5."""
    ref = make_model(seed=6)
    engine = make_engine(copy.deepcopy(ref), max_batch_size=4)
    assert engine.runner.cpu_kernel is not None
    prompts = [[5, 6, 7], [9] * 12, [11, 12], [30, 31, 32, 33, 34]]
    for p, out in zip(prompts, asyncio.run(_generate(engine, prompts, 24))):
        ids = torch.tensor([p + out.output_ids])
        with torch.no_grad():
            logits = ref(ids).logits[0, len(p) - 1 : -1]
        want = token_logprobs(logits, torch.tensor(out.output_ids))
        assert (torch.tensor(out.logprobs) - want).abs().max() < 1e-5


def test_no_compiler_means_torch_ops(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_decode, "build", cpu_decode.build.__wrapped__)  # not the cached build
    with pytest.raises(cpu_decode.KernelUnavailable):
        cpu_decode.library()
    engine = make_engine(make_model())
    assert engine.runner.cpu_kernel is None  # the engine decodes with torch ops instead
    out = asyncio.run(_generate(engine, [[5, 6, 7]]))[0]
    assert len(out.output_ids) == 8


def test_a_failed_build_says_why_and_leaves_no_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(cpu_decode, "SOURCE", bad)
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(cpu_decode.KernelUnavailable, match="failed to build"):
        cpu_decode.build.__wrapped__(tuple(cpu_decode.FLAGS))
    assert os.listdir(tmp_path / "cache") == []


def test_kernel_sampling_draws_what_torch_sampling_draws() -> None:
    """Same generator state, same tokens; log-probs to round-off; the finite flag per row."""
    from miles.engines.sampling import SamplingBatch, sample

    fast, _ = _runners(make_model(seed=7))
    kernel = fast.cpu_kernel
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=t, seed=s) for t, s in
              [(1.0, None), (0.0, None), (0.7, 5), (1.3, None), (1.0, 2), (1e-9, None)]]
    batch = SamplingBatch.build(params, [3, 4, 5, 6, 7, 8])
    for _ in range(3):
        logits = torch.randn(6, 288, generator=g) * 3
        logits[4, 17] = float("nan")
        state = torch.Generator().manual_seed(11)
        tokens, host = kernel.sample(logits, batch, state)
        want_tok, want_lp = sample(logits, batch, torch.Generator().manual_seed(11))
        ok = [0, 1, 2, 3, 5]  # row 4 has a NaN logit: its token is moot, its flag says so
        assert tokens[ok].equal(want_tok[ok]) and host[0].long().equal(tokens)
        torch.testing.assert_close(host[1, ok].float(), want_lp[ok], atol=1e-5, rtol=1e-6)
        assert host[2].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    truncating = SamplingBatch.build([SamplingParams(top_k=5)] * 6, [0] * 6)
    assert kernel.sample(logits, truncating, g) is None  # top-k / top-p rows: torch ops


def test_kernel_hashed_uniforms_are_torchs_bit_for_bit() -> None:
    """The seeded draw's uniforms from the C pass equal ``counter_uniform``'s torch ops, for
    keys over the whole int64 range (negative ones too: the arithmetic wraps), and a batch
    of seeded rows samples the same tokens through either."""
    from miles.engines.sampling import SamplingBatch, counter_uniform, row_key, sample

    fast, _ = _runners(make_model(seed=7))
    kernel = fast.cpu_kernel
    g = torch.Generator().manual_seed(3)
    keys = [row_key(s, p) for s, p in [(0, 0), (1, 5), (2**40 + 7, 3), (-5, 9)]]
    keys += torch.randint(-2**63, 2**63 - 1, (12,), generator=g, dtype=torch.int64).tolist()
    for V in (1, 7, 288, 5000):
        got = kernel.hashed_uniform(keys, V)
        want = counter_uniform(torch.tensor(keys, dtype=torch.int64), V)
        assert got.dtype == want.dtype and torch.equal(got, want), V
    batch = SamplingBatch.build([SamplingParams(temperature=1.0, seed=s) for s in range(5)], [1, 2, 3, 4, 5])
    logits = torch.randn(5, 288, generator=g)
    tokens, _ = kernel.sample(logits, batch, None)
    assert tokens.equal(sample(logits, batch, None)[0])


def test_an_unwritable_cache_falls_back_to_a_temp_folder(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import tempfile

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(blocker / "kernels"))  # mkdir fails under a file
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    lib = cpu_decode.build.__wrapped__(tuple(cpu_decode.FLAGS))
    assert lib.miles_decode_workspace is not None
    assert list((tmp_path / "tmp").glob("miles-kernels-*/cpu_decode-*.so"))


def test_a_new_build_removes_builds_unused_for_a_month(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Each edit of the source (or a new compiler, or CPU) makes a new cached build; the old
    ones must not pile up. A build removes those unused for ``STALE_DAYS`` and keeps the rest;
    loading a cached build marks it used."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(cache))
    old, recent, other = cache / "cpu_decode-0000000000000000.so", cache / "cpu_decode-1111111111111111.so", cache / "notes.so"
    for f in (old, recent, other):
        f.write_bytes(b"")
    month = (cpu_decode.STALE_DAYS + 1) * 86400
    os.utime(old, (time.time() - month, time.time() - month))
    os.utime(other, (time.time() - month, time.time() - month))
    cpu_decode.build.__wrapped__(tuple(cpu_decode.FLAGS))
    built = [p for p in cache.glob("cpu_decode-*.so") if p not in (old, recent)]
    assert len(built) == 1 and not old.exists() and recent.exists() and other.exists()
    os.utime(built[0], (time.time() - month, time.time() - month))
    cpu_decode.build.__wrapped__(tuple(cpu_decode.FLAGS))  # a cached load: marked used again
    assert built[0].stat().st_mtime > time.time() - 60


def test_gemms_below_the_bound_run_on_one_blas_thread() -> None:
    """The kernel sets one BLAS thread around each GEMM under ``one_thread_gemm`` multiply-adds
    and gives back the count it found; larger GEMMs keep the thread's count (here: a spy in
    place of MKL's setter, so this holds whatever the BLAS)."""
    model = make_model(seed=6)
    fast, _ = _runners(model)
    kernel, cfg = fast.cpu_kernel, model.config
    fast.prefill([0, 1], [[5, 6, 7], [8] * 9], logits=False)
    calls: list[int] = []
    current = [0]

    def spy(n: int) -> int:
        calls.append(n)
        before, current[0] = current[0], n
        return before

    setter = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(spy)
    kernel.set_threads = ctypes.cast(setter, ctypes.c_void_p).value
    E, I, HD = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    QKV = HD + 2 * cfg.num_key_value_heads * cfg.head_dim
    layer = [E * QKV, HD * E, E * 2 * I, I * E]  # multiply-adds per row of each GEMM of a layer
    sizes = [2 * m for m in layer * cfg.num_hidden_layers + [E * cfg.vocab_size]]  # 2 rows a step
    for bound in (1 << 40, 0, sorted(set(sizes))[1]):
        ones = sum(size < bound for size in sizes)
        calls.clear()
        kernel.one_thread_gemm = bound
        kernel.decode([1, 2], [3, 9])
        assert calls == [1, 0] * ones  # each small GEMM: set 1, then back to what it found
    assert current[0] == 0
