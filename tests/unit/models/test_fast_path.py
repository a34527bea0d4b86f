"""The compiled fast path: one copy of the step functions per role, each with code objects
of its own, so that a draft's variants are not counted against the policy's (dynamo's
recompile limit is per code object; past it a copy runs eagerly for good)."""

from __future__ import annotations

import torch

from miles.models.fused import attention_output_mlp, compile_fast_path, _own_code


def test_each_role_gets_its_own_compiled_copies() -> None:
    policy, draft = compile_fast_path(), compile_fast_path("draft")
    assert compile_fast_path() is policy and compile_fast_path("draft") is draft
    assert policy is not draft


def test_an_own_code_copy_computes_the_same() -> None:
    copy = _own_code(attention_output_mlp)
    assert copy.__code__ is not attention_output_mlp.__code__ and copy.__name__ == "attention_output_mlp"
    torch.manual_seed(0)
    h, attn = torch.randn(2, 3, 8), torch.randn(2, 2, 3, 4)
    args = (h, attn, torch.randn(8, 8), None, torch.ones(8), 1e-6, torch.randn(12, 8), torch.randn(8, 6))
    assert torch.equal(copy(*args), attention_output_mlp(*args))
