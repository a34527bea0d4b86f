"""PrefillGraphs' bookkeeping on the CPU (the graphs themselves are CUDA-only: see
tests/gpu/test_engine_gpu.py): which shapes get a graph, and when."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from miles.engines.runner import PREFILL_GRAPH_AFTER, PREFILL_GRAPH_TOKENS, PrefillGraphs


class _FakeGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def _graphs(cap: int = 64, length: int = 1024) -> PrefillGraphs:
    runner = SimpleNamespace(config=SimpleNamespace(max_batch_size=cap), cache=SimpleNamespace(length=length),
                             device=torch.device("cpu"), model=SimpleNamespace(config=SimpleNamespace(vocab_size=11)),
                             _tensor=lambda data: torch.tensor(data, dtype=torch.long))
    g = PrefillGraphs(runner)  # type: ignore[arg-type]
    g._capture = lambda step: _FakeGraph()  # type: ignore[method-assign]
    return g


def test_shapes_pad_to_buckets_and_long_ones_stay_eager() -> None:
    g = _graphs(cap=64, length=1024)
    assert g.key(3, 5) == (4, 8)
    assert g.key(17, 9) == (24, 16)
    assert g.key(64, 100) == (64, 128)
    assert g.key(1, 257) is None  # longer than the longest length bucket
    assert g.key(64, 256) is None and 64 * 256 > PREFILL_GRAPH_TOKENS  # too many padded tokens
    assert _graphs(cap=8, length=20).key(2, 17) is None  # a length bucket past the cache
    assert _graphs(cap=8).key(9, 4) is None  # more rows than slots


def test_a_shape_is_captured_when_met_again_and_replayed_after() -> None:
    g = _graphs()
    seqs = [[5, 6, 7], [8, 9]]
    outs = [g.run([0, 1], seqs) for _ in range(PREFILL_GRAPH_AFTER + 2)]
    assert outs[: PREFILL_GRAPH_AFTER - 1] == [None] * (PREFILL_GRAPH_AFTER - 1)  # eager until then
    assert all(o is not None for o in outs[PREFILL_GRAPH_AFTER - 1 :])
    assert list(g.graphs) == [(2, 8)] and g.graphs[(2, 8)].replays == 3
    # the static inputs hold the rows, padded; padding rows (none here) would use the scratch slot
    assert g.ids[:2, :3].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert g.slots[:2].tolist() == [0, 1] and g.last[:2].tolist() == [2, 1]
    g.run([4, 5, 6], [[1], [2], [3]])  # 3 rows pad to 4: the fourth goes to the scratch slot
    g.run([4, 5, 6], [[1], [2], [3]])
    assert g.slots[:4].tolist() == [4, 5, 6, g.scratch] and g.scratch == 64


def test_a_failed_capture_turns_prefill_graphs_off() -> None:
    g = _graphs()

    def boom(step):
        raise RuntimeError("capture failed")

    g._capture = boom  # type: ignore[method-assign]
    for _ in range(PREFILL_GRAPH_AFTER):
        assert g.run([0], [[1, 2]]) is None
    assert g.failed and g.run([0], [[1, 2]]) is None
