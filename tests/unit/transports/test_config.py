"""--weight-transport: what ``auto`` picks, and the combinations refused with a message."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, default_config
from miles.transports import make_receiver, make_sender, resolve_transport, transport_problems
from miles.validation import check_config


@pytest.mark.parametrize(("flags", "want"), [
    ({}, "object_store"),
    ({"device": "cuda"}, "nccl"),
    ({"device": "cuda", "colocate": True}, "cuda_ipc"),
    ({"device": "cuda", "rollout_backend": "sglang"}, "object_store"),
    ({"weight_transport": "gloo"}, "gloo"),
])
def test_auto_follows_placement(flags, want) -> None:
    assert resolve_transport(default_config(**flags)) == want


@pytest.mark.parametrize(("flags", "message"), [
    ({"weight_transport": "nccl"}, "needs the trainer and the engines on CUDA"),
    ({"weight_transport": "cuda_ipc", "device": "cuda"}, "add --colocate"),
    ({"weight_transport": "gloo", "rollout_backend": "sglang"}, "the sglang backend uses object_store"),
    ({"weight_transport_timeout_s": 0}, "--weight-transport-timeout-s must be > 0"),
])
def test_bad_combinations_are_named(flags, message) -> None:
    problems = list(transport_problems(default_config(**flags)))
    assert any(message in p for p in problems), problems


def test_check_config_reports_transport_problems(tmp_path) -> None:
    cfg = default_config(weight_transport="nccl")
    with pytest.raises(ConfigError, match="--weight-transport nccl needs"):
        check_config(cfg)


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown weight transport 'carrier_pigeon'"):
        make_sender("carrier_pigeon")
    with pytest.raises(ValueError, match="unknown transport kind"):
        make_receiver("nccl", worker_id="w")  # receivers are by update kind: "distributed"
