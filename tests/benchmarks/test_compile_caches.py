"""Compile caches, counted through dynamo's own (private) structures: the compiled seeded draw
meets no new guard after its probes, and a draft's compiled variants are not cached with the
policy's. These read torch internals that change between releases, so they live in this tier,
not the unit tier."""

from __future__ import annotations

import shutil

import pytest
import torch

from miles.engines.sampling import _call, _mix, _probes
from miles.models.fused import compile_fast_path


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_compiled_draws_meet_no_new_guard_after_the_probes() -> None:
    """The compiled seeded draw (used on CUDA) is compiled for every shape class by its
    probes, and the calls a rollout makes afterwards (one key or many, one draw or a
    vocabulary, flattened [rows, k] views for any k, grad mode on or off) build no graph.
    The old calls (views as they come, the caller's grad mode) built three more: each is a
    recompile in the middle of a rollout. Graphs are counted on the CPU, where the numbers
    are not checked: inductor's CPU int64 arithmetic differs, and the engine compiles the
    draw only for CUDA."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def graphs() -> int:
        return len(_debug_get_cache_entry_list(_mix.__code__))

    torch._dynamo.reset()
    fn = torch.compile(_mix, dynamic=True, fullgraph=True)
    for keys, vocab in _probes(torch.device("cpu")):
        _call(fn, keys, vocab)
    built = graphs()
    for rows in (1, 3, 64):
        for k in (4, 1, 2):
            keys = torch.randint(-(2**62), 2**62, (rows, k), dtype=torch.int64).reshape(-1)
            for vocab in (1000, 1):
                for grad in (False, True):
                    with torch.set_grad_enabled(grad):
                        _call(fn, keys, vocab)
    assert graphs() == built
    for rows, k in ((1, 4), (3, 1)):  # the control: the calls as they came before
        with torch.set_grad_enabled(True):
            fn(torch.randint(0, 9, (rows, k), dtype=torch.int64).reshape(-1), torch.arange(1000))
    assert graphs() > built

@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_a_drafts_variants_are_not_cached_with_the_policys() -> None:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    policy, draft = compile_fast_path(), compile_fast_path("draft")

    def entries(call) -> int:
        cells = dict(zip(call.__code__.co_freevars, (c.cell_contents for c in call.__closure__)))
        return len(_debug_get_cache_entry_list(cells["fn"].__code__))

    before = entries(policy.attention_output), entries(draft.attention_output)
    draft.attention_output(torch.randn(2, 5, 16).double(), torch.randn(2, 2, 5, 8).double(),
                           torch.randn(16, 16).double(), None)  # another dtype: a new variant
    assert entries(draft.attention_output) == before[1] + 1
    assert entries(policy.attention_output) == before[0]