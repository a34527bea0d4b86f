"""Micro-batches in Megatron's sequence layout, and the response log-probs from its hidden states.

A ``MicroBatch`` is a ``TokenBatch`` (``miles.trainers.batching``: right-padded, response
token j of row n predicted by the hidden state at position P_n + j − 1) plus where its
positions live on this rank:

- the sequence is right-padded to a multiple of 2·cp (context parallel) × tp (sequence
  parallel), so trailing pads never reach a real token under causal attention;
- context-parallel rank r holds chunks r and 2·cp−1−r of 2·cp (Megatron's load-balanced
  causal split, which its RoPE slicing assumes); ``pos_to_local`` maps a global position
  to its row in this rank's (sequence-parallel-gathered) hidden states, −1 elsewhere;
- ``router_positions``: the positions a MoE router on this rank sees, in its token order
  (the routing replay lays the recorded experts out in it).

``response_logprobs`` applies the LM head only at the positions that predict response
tokens: tensor-parallel rank 1 uses the trainer's fused, memory-lean ``linear_logprobs``
(the embedded trainer's arithmetic, so both backends compute the same numbers); with a
vocab split over TP ranks (or an entropy bonus) the vocab-parallel log-softmax below.
Padded vocabulary rows are masked out of every softmax. With context parallelism each rank
fills its own positions and the [n, R] result is summed over CP ranks (identity backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.trainers.batching import TokenBatch
from miles.trainers.logprobs import linear_logprobs
from miles.trainers.megatron.distributed import Layout, all_reduce_sum, copy_to_group, group_size


@dataclass
class MicroBatch:
    tb: TokenBatch
    rows: list[int]  # rows of the step's full batch
    input_ids: Tensor  # [b, s_local]
    position_ids: Tensor  # [b, s_local]
    pos_to_local: Tensor  # [S_pad] long
    router_positions: Tensor  # [s_router] long
    weight: float = 1.0  # 0 for a placeholder (a data-parallel rank without rows)


def padded_length(length: int, layout: Layout) -> int:
    multiple = (2 * layout.cp if layout.cp > 1 else 1) * (layout.tp if layout.sequence_parallel else 1)
    return -(-length // multiple) * multiple


def cp_positions(length: int, cp: int, cp_rank: int, device: torch.device | str = "cpu") -> Tensor:
    """Global positions held by context-parallel rank ``cp_rank`` (``length`` divisible by 2·cp)."""
    if cp == 1:
        return torch.arange(length, device=device)
    chunk = length // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def make_micro_batch(tb: TokenBatch, rows: list[int], layout: Layout, weight: float = 1.0) -> MicroBatch:
    b, length = tb.input_ids.shape
    padded = padded_length(length, layout)
    ids = torch.nn.functional.pad(tb.input_ids, (0, padded - length))
    device = ids.device
    pos = cp_positions(padded, layout.cp, layout.cp_rank, device)
    pos_to_local = torch.full((padded,), -1, dtype=torch.long, device=device)
    pos_to_local[pos] = torch.arange(pos.numel(), device=device)
    router = pos.chunk(layout.tp)[layout.tp_rank] if layout.sequence_parallel else pos
    return MicroBatch(tb=tb, rows=list(rows), input_ids=ids[:, pos].contiguous(),
                      position_ids=pos[None, :].expand(b, -1).contiguous(), pos_to_local=pos_to_local,
                      router_positions=router, weight=weight)


def replay_targets(mb: MicroBatch, num_moe_layers: int, topk: int) -> tuple[Tensor, Tensor]:
    """(expert ids [s_router·b, L_moe, k], replayed [s_router·b] bool) in the router's token
    order (sequence-major: token s·b + n), from the recorded response routing."""
    tb = mb.tb
    assert tb.routing is not None
    b = tb.input_ids.shape[0]
    padded = mb.pos_to_local.numel()
    device = tb.input_ids.device
    full = torch.zeros(b, padded, num_moe_layers, topk, dtype=torch.long, device=device)
    mask = torch.zeros(b, padded, dtype=torch.bool, device=device)
    rows, cols, pos = tb.response_positions()
    full[rows, pos] = tb.routing[rows, cols]
    mask[rows, pos] = True
    sel = full[:, mb.router_positions].transpose(0, 1).reshape(-1, num_moe_layers, topk)
    return sel, mask[:, mb.router_positions].transpose(0, 1).reshape(-1)


def _reduce_max(x: Tensor, group: Any) -> Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def vocab_parallel_logprobs(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float,
    vocab_size: int,
    vocab_start: int = 0,
    group: Any = None,
    entropy: str = "none",
) -> tuple[Tensor, Tensor | None]:
    """log softmax(h @ Wᵀ / T)[target] with W's rows split over ``group`` (this rank: rows
    ``[vocab_start, vocab_start + W.shape[0])``; rows ≥ ``vocab_size`` are padding), in float32,
    and the entropy ("metric": no gradient; "grad": differentiable)."""
    h = copy_to_group(h, group)
    logits = h @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # fp32 (fp64 in checks)
    shard = weight.shape[0]
    valid = torch.arange(vocab_start, vocab_start + shard, device=h.device) < vocab_size
    logits = logits.masked_fill(~valid, float("-inf"))
    gmax = _reduce_max(logits.detach().max(dim=-1).values, group)
    shifted = logits - gmax[:, None]
    lse = torch.log(all_reduce_sum(shifted.exp().sum(-1), group))
    local = targets - vocab_start
    mine = (local >= 0) & (local < shard)
    picked = shifted.gather(1, local.clamp(0, shard - 1)[:, None]).squeeze(1)
    logp = all_reduce_sum(torch.where(mine, picked, torch.zeros_like(picked)), group) - lse
    if entropy == "none":
        return logp, None
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        p = torch.exp(shifted - lse[:, None])
        expected = all_reduce_sum((p * shifted.masked_fill(~valid, 0.0)).sum(-1), group)
        ent = lse - expected
    return logp, ent


def response_logprobs(
    hidden: Tensor,
    weight: Tensor,
    mb: MicroBatch,
    *,
    temperature: float,
    vocab_size: int,
    layout: Layout,
    grp: dict[str, Any],
    entropy: str = "none",
) -> tuple[Tensor, Tensor | None]:
    """(logp, entropy) as [n, R] float32 tensors (0 on padding) from the decoder's hidden
    states [s_local, b, h] and this rank's LM-head shard ``weight`` [V_pad/tp, h]."""
    if layout.sequence_parallel:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    tb = mb.tb
    rows, cols, pos = tb.response_positions()
    local = mb.pos_to_local[pos]
    keep = local >= 0
    rows, cols, local = rows[keep], cols[keep], local[keep]
    h = hidden.transpose(0, 1)[rows, local]
    targets = tb.response_ids[rows, cols]
    if layout.tp == 1 and entropy != "grad":
        logp_flat, ent_flat = linear_logprobs(h, weight[:vocab_size], targets, temperature=temperature,
                                              dtype=h.dtype, with_entropy=entropy == "metric")
    else:
        logp_flat, ent_flat = vocab_parallel_logprobs(
            h, weight, targets, temperature=temperature, vocab_size=vocab_size,
            vocab_start=layout.tp_rank * weight.shape[0], group=grp.get("tp"), entropy=entropy)
    shape = tb.response_ids.shape
    logp = torch.zeros(shape, dtype=torch.float32, device=h.device).index_put((rows, cols), logp_flat.float())
    ent = None
    if ent_flat is not None:
        ent = torch.zeros(shape, dtype=torch.float32, device=h.device).index_put((rows, cols), ent_flat.float())
    if layout.cp > 1:
        logp = all_reduce_sum(logp, grp["cp"])
        ent = None if ent is None else all_reduce_sum(ent, grp["cp"])
    return logp, ent
