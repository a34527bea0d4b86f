"""Megatron sequence layout of a micro-batch (pure): context-parallel chunks, position maps,
and the replay targets in the router's token order."""

from __future__ import annotations

import torch

from miles.trainers.batching import build_batch
from miles.trainers.megatron.distributed import Layout
from miles.trainers.megatron.sequence import cp_positions, make_micro_batch, padded_length, replay_targets
from tests.unit.trainers.conftest import make_traj


def test_context_parallel_chunks_are_load_balanced() -> None:
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = torch.cat([cp_positions(24, 3, r) for r in range(3)]).sort().values
    assert held.tolist() == list(range(24))
    assert cp_positions(5, 1, 0).tolist() == list(range(5))


def test_padded_length() -> None:
    assert padded_length(7, Layout()) == 7
    assert padded_length(7, Layout(cp=2)) == 8
    assert padded_length(9, Layout(cp=2, tp=2, sequence_parallel=True)) == 16
    assert padded_length(9, Layout(tp=2)) == 9  # no sequence parallelism: no constraint


def _batch(routing: bool = False):
    trajs = [make_traj("a", 0, [5, 6, 7], [10, 11]), make_traj("b", 0, [8], [12, 13, 14])]
    if routing:
        for t, base in zip(trajs, (100, 200)):
            t.routed_experts = [[[base + j, base + j + 50]] for j in range(len(t.response_tokens))]
    return build_batch(trajs, device="cpu", vocab_size=288, routing_shape=(1, 2) if routing else None)


def test_micro_batch_positions_on_a_context_parallel_rank() -> None:
    tb = _batch()
    mb = make_micro_batch(tb, [0, 1], Layout(cp=2, cp_rank=1))
    assert mb.input_ids.shape == (2, 4)  # length 5 → 8; rank 1 holds positions 2..5
    assert torch.equal(mb.input_ids, torch.nn.functional.pad(tb.input_ids, (0, 3))[:, 2:6])
    assert mb.pos_to_local.tolist() == [-1, -1, 0, 1, 2, 3, -1, -1]
    assert mb.position_ids[0].tolist() == [2, 3, 4, 5]


def test_replay_targets_follow_the_router_token_order() -> None:
    tb = _batch(routing=True)
    mb = make_micro_batch(tb, [0, 1], Layout())
    targets, mask = replay_targets(mb, num_moe_layers=1, topk=2)
    b, s = tb.input_ids.shape
    assert targets.shape == (s * b, 1, 2) and mask.shape == (s * b,)

    def at(n: int, pos: int) -> tuple[list[int], bool]:  # router token s·b + n
        i = pos * b + n
        return targets[i, 0].tolist(), bool(mask[i])

    # row 0: prompt of 3, response token j is predicted at position 2 + j
    assert at(0, 2) == ([100, 150], True) and at(0, 3) == ([101, 151], True)
    assert at(1, 0) == ([200, 250], True) and at(1, 2) == ([202, 252], True)
    assert at(0, 0)[1] is False and at(0, 4)[1] is False and at(1, 3)[1] is False
