"""Model on CUDA: checkpoint IO to the device, float32 parity with the CPU and with
transformers, bf16 closeness, and the fused / compiled fast path against the module path."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.models import CausalLM, load_pretrained, save_pretrained, tiny_config  # noqa: E402
from miles.models.fused import compile_fast_path  # noqa: E402


def _model(moe: bool = False) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(tiny_config(moe=moe, initializer_range=0.1)).eval()


@pytest.mark.parametrize("moe", [False, True])
def test_cuda_float32_matches_cpu_and_transformers(tmp_path, moe: bool) -> None:
    transformers = pytest.importorskip("transformers")
    cpu = _model(moe)
    save_pretrained(cpu, tmp_path)
    gpu = load_pretrained(tmp_path, dtype=torch.float32, device="cuda")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    ids = torch.randint(0, cpu.config.vocab_size, (3, 50))
    with torch.no_grad():
        ref = cpu(ids).logits
        ours = gpu(ids.cuda()).logits.cpu()
        theirs = hf(ids.cuda()).logits.float().cpu()
    assert (ours - ref).abs().max() < 1e-4
    assert (ours - theirs).abs().max() < 1e-4


def test_bf16_close_to_float32(tmp_path) -> None:
    save_pretrained(_model(), tmp_path)
    f32 = load_pretrained(tmp_path, dtype=torch.float32, device="cuda")
    bf16 = load_pretrained(tmp_path, device="cuda")
    assert bf16.dtype == torch.bfloat16
    ids = torch.randint(0, 288, (2, 64), device="cuda")
    with torch.no_grad():
        p32 = f32(ids).logits.softmax(-1)
        p16 = bf16(ids).logits.softmax(-1)
    assert (p32 - p16).abs().max() < 0.05


@pytest.mark.parametrize("compiled", [False, True])
def test_fast_path_matches_module_path(compiled: bool) -> None:
    ref = _model().cuda()
    fast = _model().cuda().requires_grad_(False)
    fast.fuse_projections(compile_fast_path() if compiled else None)
    ids = torch.randint(0, 288, (4, 33), device="cuda")
    with torch.no_grad():
        assert (ref(ids).logits - fast(ids).logits).abs().max() < 1e-4
    assert fast.state_dict().keys() == ref.state_dict().keys()
