"""``miles serve`` on CUDA and the adapter's NCCL weight path. Skipped without CUDA; the
NCCL test needs two GPUs (NCCL refuses two ranks on one device): the server runs on GPU 1,
the adapter's process (rank 0, the sender) on GPU 0."""

from __future__ import annotations

import pytest
import torch

from miles.engines.sglang import SGLangConfig, SGLangEngine
from miles.types import GenerateRequest, SamplingParams
from tests.integration.serve_util import full_forward_logprobs, load, make_checkpoint, run, serve

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPT = [40, 12, 250, 9, 77]


def _perturbed(ck):
    model = load(ck)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def _check_update(url, ck, backend: str) -> None:
    new = _perturbed(ck)

    async def go():
        eng = SGLangEngine(SGLangConfig(sglang_urls=[url], sglang_weight_backend=backend), url=url,
                           model_path=str(ck))
        await eng.start()
        await eng.update_weights(new.state_dict().items(), eng.version + 1)
        out = await eng.generate(GenerateRequest(rid=f"gpu-{backend}", input_ids=PROMPT, sampling=SamplingParams(
            max_new_tokens=16, seed=1, ignore_eos=True)))
        await eng.close()
        return eng.version, out

    version, out = run(go())
    assert out.finish_reason == "length" and out.versions == [version] * 16
    ref = full_forward_logprobs(new, PROMPT, out.output_ids, 1.0)
    assert (ref - torch.tensor(out.logprobs)).abs().max().item() < 1e-3  # float32 on the GPU (TF32 off)


def test_cuda_server_with_gloo_updates(tmp_path) -> None:
    ck = make_checkpoint(tmp_path / "ck")
    with serve(ck, "--device", "cuda", "--dtype", "float32", "--max-seq-len", "256", log_dir=tmp_path) as url:
        _check_update(url, ck, "gloo")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the two ranks on two GPUs")
def test_nccl_weight_updates_between_two_gpus(tmp_path) -> None:
    ck = make_checkpoint(tmp_path / "ck")
    torch.cuda.set_device(0)
    with serve(ck, "--device", "cuda", "--dtype", "float32", "--max-seq-len", "256", log_dir=tmp_path,
               env={"CUDA_VISIBLE_DEVICES": "1"}) as url:
        _check_update(url, ck, "nccl")
