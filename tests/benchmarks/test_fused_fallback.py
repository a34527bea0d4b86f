"""The shared compiled fast path falls back to eager once dynamo refuses another variant
(seen on the H200: a process that built many models passed the recompile limit, and with
``fullgraph=True`` that was a hard error in the middle of decoding)."""

from __future__ import annotations

import torch

from miles.models.fused import _compiled_or_eager


def test_recompile_limit_turns_into_eager() -> None:
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        fn = _compiled_or_eager(double, {"fullgraph": True, "backend": "eager", "dynamic": False})
        for dtype in (torch.float32, torch.float64, torch.float16):  # each dtype is a new variant
            x = torch.arange(4, dtype=dtype)
            assert torch.equal(fn(x), x * 2)
    torch._dynamo.reset()
    assert torch._dynamo.config.recompile_limit > 1
