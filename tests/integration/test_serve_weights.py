"""The SGLang adapter (SGLangEngine) against ``miles serve``: generation, weight updates
through the distributed (gloo) and disk paths with the version echoed, per-token versions
across an update mid-generation, failures that leave the server serving, and the adapter
driven by a RolloutWorker.

Versions only go up on the module's one server, so the tests run in file order and each
reads the version it starts from.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.actors.rollout_worker import RolloutWorker
from miles.engines.sglang import SGLangConfig, SGLangEngine, SGLangError
from miles.utils.net import free_port
from miles.models import build_tiny_tokenizer
from miles.protocols import RolloutEngine
from miles.rollout import GenerateContext, generate_single_turn
from miles.transports import weight_sync
from miles.types import GenerateRequest, SamplingParams, Status, Trajectory
from miles.transports.weights import pack

from .serve_util import full_forward_logprobs, load, make_checkpoint, request, run, serve, wait_running

TOL = 1e-5
PROMPT = [40, 12, 250, 9, 77]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ck = make_checkpoint(tmp_path_factory.mktemp("ck"), seed=1)
    # updates land while requests generate: the torch-ops decode path keeps them running long
    # enough for the tests' HTTP round trips (the CPU kernel makes 200 tokens in ~20 ms)
    with serve(ck, "--max-seq-len", "512", "--max-batch-size", "8", "--no-cpu-decode-kernel",
               log_dir=tmp_path_factory.mktemp("log")) as url:
        yield url, ck


def _adapter(url, ck, **config) -> SGLangEngine:
    return SGLangEngine(SGLangConfig(sglang_urls=[url], **config), url=url, model_path=str(ck))


def _perturbed(ck, seed: int):
    """The checkpoint's model with every weight moved a little (a "trained" policy)."""
    model = load(ck)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def _request(rid, n=24, seed=3, temperature=1.0):
    return GenerateRequest(rid=rid, input_ids=PROMPT, sampling=SamplingParams(
        max_new_tokens=n, temperature=temperature, seed=seed, ignore_eos=True))


async def _version(url) -> str:
    return (await request(url, "/model_info", method="GET"))[1]["weight_version"]


def test_adapter_generates_with_logprobs_of_the_checkpoint(server) -> None:
    url, ck = server

    async def go():
        eng = _adapter(url, ck)
        assert isinstance(eng, RolloutEngine)
        out = await eng.generate(_request("gen-0"))
        await eng.close()
        return eng, out

    eng, out = run(go())
    assert out.finish_reason == "length" and len(out.output_ids) == 24 and out.versions == [0] * 24
    ref = full_forward_logprobs(load(ck), PROMPT, out.output_ids, 1.0)
    assert (ref - torch.tensor(out.logprobs)).abs().max().item() < TOL
    assert eng.version == 0


@pytest.mark.parametrize("path", ["distributed", "disk"])
def test_weight_update_lands_and_the_version_is_echoed(server, path) -> None:
    url, ck = server
    new = _perturbed(ck, seed=len(path))

    async def go():
        eng = _adapter(url, ck, sglang_weight_update=path)
        await eng.start()
        version = eng.version + 1
        for name, tensor in new.state_dict().items():  # staged one tensor per call, as buckets arrive
            eng.stage_weights([(name, tensor)])
        await eng.commit_weights(version)
        out = await eng.generate(_request(f"after-{path}"))
        raw = (await request(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}))[1]
        info = await _version(url)
        await eng.close()
        return version, eng, out, raw, info

    version, eng, out, raw, info = run(go())
    assert eng.version == version and info == str(version)
    assert raw["meta_info"]["weight_version"] == str(version)
    assert out.versions == [version] * len(out.output_ids)
    ref = full_forward_logprobs(new, PROMPT, out.output_ids, 1.0)
    assert (ref - torch.tensor(out.logprobs)).abs().max().item() < TOL  # the new weights are in


def test_per_tensor_broadcast_from_another_sender(server) -> None:
    """The server's non-bucketed path, driven the way another trainer (slime's) would."""
    url, ck = server
    new = _perturbed(ck, seed=7)
    named = list(new.state_dict().items())

    async def go():
        port = free_port()
        init = asyncio.ensure_future(request(url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "other-trainer", "backend": "gloo"}))
        group = await asyncio.to_thread(weight_sync.init_group, master_address="127.0.0.1", master_port=port,
                                        rank=0, world_size=2, group_name="other-trainer", backend="gloo",
                                        timeout_s=60)
        assert (await init)[0] == 200
        version = int(await _version(url)) + 1
        update = asyncio.ensure_future(request(url, "/update_weights_from_distributed", {
            **weight_sync.describe(named), "group_name": "other-trainer", "weight_version": str(version)}))
        for work, _ in weight_sync.start_send(group, named, flattened=False, device="cpu"):
            await asyncio.to_thread(work.wait)
        status, data = await update
        destroyed = await request(url, "/destroy_weights_update_group", {"group_name": "other-trainer"})
        weight_sync.destroy_group(group)
        gen = (await request(url, "/generate", {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 8, "sampling_seed": 1}}))[1]
        return version, status, data, destroyed[0], await _version(url), gen["meta_info"]

    version, status, data, destroyed, info, meta = run(go())
    assert status == 200 and data["success"], data
    assert destroyed == 200 and info == str(version) and meta["weight_version"] == str(version)
    ids, lps = [e[1] for e in meta["output_token_logprobs"]], [e[0] for e in meta["output_token_logprobs"]]
    assert (full_forward_logprobs(new, PROMPT, ids, 1.0) - torch.tensor(lps)).abs().max().item() < TOL


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_versions_per_token_across_an_update_mid_generation(server, mode) -> None:
    url, ck = server
    old, new = _perturbed(ck, seed=30 + len(mode)), _perturbed(ck, seed=40 + len(mode))

    async def go():
        eng = _adapter(url, ck, sglang_pause_mode=mode)
        await eng.start()
        v_old = eng.version + 1
        await eng.update_weights(old.state_dict().items(), v_old)  # known weights to start from
        task = asyncio.ensure_future(eng.generate(_request(f"long-{mode}", n=400, seed=4)))
        await wait_running(url)
        eng.stage_weights(new.state_dict().items())
        await eng.commit_weights(v_old + 1, keep_kv_cache=(mode == "in_place"))
        out = await task
        await eng.close()
        return v_old, out

    v_old, out = run(go())
    k = out.versions.count(v_old)
    assert out.finish_reason == "length" and len(out.output_ids) == 400
    assert out.versions == [v_old] * k + [v_old + 1] * (400 - k)
    assert 0 < k < 400, "the update did not land mid-generation"
    old_ref = full_forward_logprobs(old, PROMPT, out.output_ids, 1.0)
    assert (old_ref[:k] - torch.tensor(out.logprobs[:k])).abs().max().item() < TOL
    if mode == "retract":  # the KV cache was recomputed: the new tokens are exactly the new model's
        new_ref = full_forward_logprobs(new, PROMPT, out.output_ids, 1.0)
        assert (new_ref[k:] - torch.tensor(out.logprobs[k:])).abs().max().item() < TOL


def test_bad_updates_leave_the_server_serving(server) -> None:
    url, ck = server

    async def go():
        eng = _adapter(url, ck, sglang_timeout_s=20)
        await eng.start()
        before = eng.version
        eng.stage_weights([("model.layers.0.not_a_weight", torch.zeros(3))])
        with pytest.raises(SGLangError, match="not_a_weight"):
            await eng.commit_weights(before + 1)
        with pytest.raises(ValueError, match="older"):
            await eng.commit_weights(before - 1)
        eng.stage_weights([("", torch.zeros(2))])  # refused before any broadcast is received
        with pytest.raises(SGLangError, match="tensor name"):
            await eng.commit_weights(before + 1)
        eng.stage_weights(load(ck).state_dict().items())  # a new group replaces the broken one
        await eng.commit_weights(before + 1)
        before += 1
        eng.config.sglang_weight_update = "disk"
        eng.stage_weights([("lm_head.weight", torch.zeros(2, 2))])
        with pytest.raises(SGLangError, match="shape"):
            await eng.commit_weights(before + 1)
        out = await eng.generate(_request("still-serving", n=4))
        version = await eng.fetch_version()
        await eng.close()
        return before, version, out

    before, version, out = run(go())
    assert version == before and out.finish_reason == "length" and out.versions == [before] * 4


def test_an_engine_failure_is_reported_and_the_server_keeps_serving(server) -> None:
    url, ck = server

    async def go():
        eng = _adapter(url, ck)
        await eng.start()
        v = eng.version
        head = load(ck).lm_head.weight
        await eng.update_weights([("lm_head.weight", torch.full_like(head, 3e38))], v)  # logits overflow
        _, raw = await request(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
        failed = await eng.generate(_request("overflow", n=4))
        await eng.update_weights(load(ck).state_dict().items(), v + 1)
        fine = await eng.generate(_request("after-repair", n=4))
        await eng.close()
        return raw, failed, fine

    raw, failed, fine = run(go())
    reason = raw["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500 and "non-finite" in reason["message"]
    assert failed.finish_reason == "error" and "non-finite" in failed.error
    assert fine.finish_reason == "length" and len(fine.output_ids) == 4


class _Buffer:
    """The calls a RolloutWorker makes on its buffer, in memory; PARTIAL goes back."""

    def __init__(self, trajs):
        self.pending, self.done = list(trajs), []

    def lease(self, worker_id, n):
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def put_many(self, trajs, worker_id):
        for t in trajs:
            (self.pending if t.status is Status.PARTIAL else self.done).append(t)

    def put_and_lease_async(self, trajs, worker_id, n, wait_s):
        self.put_many(trajs, worker_id)
        return self.lease(worker_id, n)

    def renew(self, worker_id):
        return None


def test_rollout_worker_drives_the_adapter(server) -> None:
    url, ck = server
    new = _perturbed(ck, seed=99)
    tok = build_tiny_tokenizer()

    async def go():
        eng = _adapter(url, ck)
        await eng.start()
        v0 = eng.version
        trajs = [Trajectory(id=f"t{i}", prompt_id=f"p{i}", group_id=f"p{i}", prompt_tokens=PROMPT[: 3 + i])
                 for i in range(4)]
        buffer = _Buffer(trajs)
        ctx = GenerateContext(engine=eng, tokenizer=tok, max_response_len=300, seed=5,
                              sampling=SamplingParams(max_new_tokens=300, ignore_eos=True))
        worker = RolloutWorker("w0", engine=eng, context=ctx, generate_fn=generate_single_turn,
                               buffer=buffer, partial_rollout=True, keep_kv_cache=True)
        loop = asyncio.ensure_future(worker.run())
        await wait_running(url, 4)
        bucket = pack(list(new.state_dict().items()), version=v0 + 1, index=0, total=1)
        assert await worker.receive_weights(v0 + 1, [bucket]) == v0 + 1
        assert await worker.abort_inflight() >= 0  # whatever is still running comes back PARTIAL
        while len(buffer.done) < 4:
            await asyncio.sleep(0.01)
        await worker.stop()
        await loop
        await eng.close()
        return v0, buffer.done

    v0, done = run(go())
    assert sorted(t.id for t in done) == ["t0", "t1", "t2", "t3"]
    for t in done:
        t.validate(current_version=v0 + 1)
        assert t.status is Status.TRUNCATED and t.response_tokens
        assert t.versions == sorted(t.versions) and set(t.versions) <= {v0, v0 + 1}
    assert any(v0 + 1 in t.versions for t in done)
    assert any(t.num_segments > 1 for t in done)  # aborted, recycled, resumed
