"""--quantization and friends: the flags, and the bad combinations refused before a run."""

from __future__ import annotations

import pytest
import torch

from miles.config import default_config
from miles.models import CausalLM, save_pretrained, tiny_config
from miles.validation import _quant_problems


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense")
    save_pretrained(CausalLM(tiny_config()), path)
    return str(path)


def test_modes_choose_engine_and_trainer_specs() -> None:
    unified = default_config(quantization="fp8").quant
    assert unified.engine_spec() == unified.trainer_spec() and unified.engine_spec().kind == "fp8"
    rollout_only = default_config(rollout_quantization="fp8").quant
    assert rollout_only.engine_spec().kind == "fp8" and rollout_only.trainer_spec() is None
    qat = default_config(quantization="int4-qat", int4_group_size=64, int4_targets="all-linear").quant
    assert qat.trainer_spec().kind == "int4" and qat.trainer_spec().group_size == 64
    assert default_config().quant.engine_spec() is None


@pytest.mark.parametrize(("flags", "message"), [
    (dict(quantization="int4-qat", int4_group_size=48, int4_targets="all-linear"),
     "--int4-group-size 48 does not divide the input dimension 64"),
    (dict(quantization="int4-qat", int4_group_size=32), "a dense model: use --int4-targets all-linear"),
    (dict(quantization="fp8", rollout_quantization="fp8"), "drop --rollout-quantization"),
    (dict(quantization="fp8", rollout_backend="sglang"), "need --rollout-backend embedded"),
    (dict(quantization="fp8", weight_update_changed_only=True), "--weight-update-changed-only cannot"),
])
def test_bad_combinations_are_named(dense_ckpt, flags, message) -> None:
    problems = list(_quant_problems(default_config(hf_checkpoint=dense_ckpt, **flags)))
    assert any(message in p for p in problems), problems


def test_fp8_on_a_gpu_without_fp8_gemms_is_refused(monkeypatch) -> None:
    from miles.models.quant import QuantSpec, check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability 8.9" in check_device(QuantSpec("fp8"), "cuda")
    assert check_device(QuantSpec("int4"), "cuda") is None


def test_uncorrected_fp8_rollouts_get_a_note() -> None:
    from miles.validation import notes

    def fp8_notes(**flags):
        return [n for n in notes(default_config(rollout_quantization="fp8", **flags)) if "--rollout-quantization" in n]

    assert fp8_notes(mode="sync") and "--use-tis" in fp8_notes(mode="sync")[0]
    assert not fp8_notes(mode="sync", use_tis=True)
    assert not fp8_notes(mode="async")  # the stale modes' default correction covers it
    assert not [n for n in notes(default_config(quantization="fp8", mode="sync")) if "quantization" in n]
