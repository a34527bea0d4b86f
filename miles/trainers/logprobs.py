"""Response-token log-probs (and entropy) of a TokenBatch under a CausalLM.

The model runs with ``return_logits=False, return_hidden=True``; the LM head is applied
here, only at the positions that predict response tokens, through ``linear_logprobs`` —
an autograd function that keeps the [M, V] logits (and, in backward, their gradient) in
the compute dtype (bf16 on GPU) and never materialises a float32 [M, V] tensor beyond one
row chunk. For a 151k vocabulary and a 32k-token micro-batch that is ~10 GB per buffer
instead of ~20 GB for each of the several float32 tensors a plain log_softmax keeps. Log-softmax runs in float32, in row chunks, dividing the logits by
the rollout temperature first — the same arithmetic as ``miles.models.token_logprobs``,
which the engine records behaviour log-probs with.

When the entropy bonus needs a gradient, or the model is FSDP-sharded (the LM head weight
is only gathered inside the model's own forward), the plain path is used instead: the
model's float32 logits and ``token_logprobs``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from miles.models import invariant, token_logprobs
from miles.models.layers import UnpaddedAttention
from miles.trainers.batching import TokenBatch

CHUNK_BYTES = 1 << 30  # float32 working set per log-softmax chunk


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


def _lse_rows(logits: Tensor, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor]:
    """(logsumexp, entropy or an empty tensor) of logits / temperature, row by row, in
    float32 (float64 for float64 logits)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lse = torch.logsumexp(x, dim=-1)
    if not with_entropy:
        return lse, lse.new_zeros(0)
    return lse, lse - (torch.softmax(x, dim=-1) * x).sum(-1)


def _split_of(vocab: int, parts: int = 32, least: int = 1024) -> int:
    """Into how many equal pieces ``_lse_split_rows`` cuts a row: the largest power of two
    up to ``parts`` that divides ``vocab`` and leaves pieces of at least ``least``."""
    n = parts
    while n > 1 and (vocab % n or vocab // n < least):
        n //= 2
    return n


def _lse_split_rows(logits: Tensor, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor]:
    """``_lse_rows`` for the compiler, each row reduced as ``_split_of(V)`` pieces, then the
    pieces merged exactly (max, rescaled sums). Inductor reduces a 151,936-wide row in one
    program that reads it once per statistic (max, sum of exp, entropy's sum), far below the
    copy bandwidth with so few programs. Pieces of ~4.7k give
    it 32× the programs, and a piece stays in cache between its reads. The same
    arithmetic as ``_lse_rows`` up to the order of float32 sums."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    M, V = x.shape
    xs = x.view(M, _split_of(V), -1)
    m_part = xs.amax(-1, keepdim=True)  # [M, n, 1]
    e = torch.exp(xs - m_part)
    m = m_part.amax(1)  # [M, 1]
    w = torch.exp(m_part.squeeze(-1) - m)  # [M, n]: each piece's rescale to the row max
    s = (e.sum(-1) * w).sum(-1)
    lse = m.squeeze(-1) + torch.log(s)
    if not with_entropy:
        return lse, lse.new_zeros(0)
    return lse, lse - ((e * xs).sum(-1) * w).sum(-1) / s


def _grad_rows(logits: Tensor, lse: Tensor, targets: Tensor, g: Tensor, temperature: float) -> Tensor:
    """d logp_i / d logit_iv · g_i = (1[v = target_i] − p_iv) · g_i / t, in the logits' dtype.
    Written for the compiler: every step is elementwise, so it fuses into one pass."""
    x = logits.to(lse.dtype) / temperature
    p = torch.exp(x - lse[:, None])
    hit = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    return ((hit.to(p.dtype) - p) * (g / temperature)[:, None]).to(logits.dtype)


def _grad_rows_into(out: Tensor, logits: Tensor, lse: Tensor, targets: Tensor, g: Tensor,
                    temperature: float) -> None:
    """``_grad_rows`` written into ``out`` (a row chunk of the gradient): compiled, the
    kernel stores there directly instead of returning a tensor to copy."""
    out.copy_(_grad_rows(logits, lse, targets, g, temperature))


def _grad_rows_eager(logits: Tensor, lse: Tensor, targets: Tensor, g: Tensor, temperature: float) -> Tensor:
    """``_grad_rows`` for eager mode, where each op is a full pass over the chunk: in place on
    one float32 copy, the target's term added by a scatter (the compiled form's one-hot
    compare costs eager two extra [rows, V] passes, a visible share of a small model's step)."""
    gt = g / temperature
    x = logits.to(lse.dtype, copy=True)  # float64 logits (checks) are saved for backward: never in place
    x.div_(temperature).sub_(lse[:, None]).exp_().mul_(-gt[:, None])
    x.scatter_add_(1, targets[:, None], gt[:, None])
    return x.to(logits.dtype)


def _grad_rows_eager_into(out: Tensor, logits: Tensor, lse: Tensor, targets: Tensor, g: Tensor,
                          temperature: float) -> None:
    out.copy_(_grad_rows_eager(logits, lse, targets, g, temperature))


# The same two functions under torch.compile (the compiled trainer's path): each becomes one
# kernel that reads the bf16 logits once (twice for the reduction) and writes only what it
# returns. Eager, every step of the arithmetic is a full pass over an [M, V] float32 tensor:
# the casts, divides and exps of these functions are a quarter of a small model's train
# step in a GPU profile. Both run in row chunks (``_row_chunks``): eager to bound that float32 memory,
# compiled to bound the row count it is compiled for (below).
#
# Only the row count is dynamic; the vocabulary stays a compile-time constant. Compiled with
# every size dynamic, the [M, V] kernels found each element's row by an integer division by
# the runtime V, which left the gradient kernel and the log-sum-exp at a fraction of the copy
# bandwidth, a tenth of a small model's train step. The
# rows also come in chunks of at most COMPILED_ROWS, a bound dynamo is told, so that the
# compiler can prove rows × V < 2³¹ and index in 32 bits (a 14k-row micro-batch of a 152k
# vocabulary is 2.2·10⁹ elements). It keeps the indexing correct; it does not make the
# kernels faster, and they stay below the copy bandwidth.
COMPILED_ROWS = 4096
_compiled: dict[str, Any] = {}


def _rows_dynamic(fn: Any) -> Any:
    """``fn`` compiled with dim 0 (the rows, 2..COMPILED_ROWS) of each tensor argument
    dynamic and dim 1 (the vocabulary) static. Both are marked on every call: dynamo's
    automatic-dynamic state would otherwise make the vocabulary dynamic once a second size
    (a draft's) came by."""
    compiled = torch.compile(fn)

    def call(*args: Any) -> Any:
        for a in args:
            if isinstance(a, Tensor) and a.ndim:
                torch._dynamo.mark_dynamic(a, 0, min=2, max=COMPILED_ROWS)
                if a.ndim > 1:
                    torch._dynamo.mark_static(a, 1)
        return compiled(*args)

    return call


def _kernels(compiled: bool) -> tuple[Any, Any]:
    """(log-sum-exp of rows, gradient of rows into a buffer), compiled or eager."""
    if not compiled:
        return _lse_rows, _grad_rows_eager_into
    if not _compiled:
        _compiled["lse"] = _rows_dynamic(_lse_split_rows)
        _compiled["grad"] = _rows_dynamic(_grad_rows_into)
    return _compiled["lse"], _compiled["grad"]


def _row_chunks(M: int, V: int, compiled: bool) -> list[tuple[slice, bool]]:
    """Row slices and whether each runs compiled: COMPILED_ROWS at a time compiled (a chunk
    of one row runs eagerly: dynamo specialises sizes 0 and 1), else chunks of CHUNK_BYTES."""
    step = COMPILED_ROWS if compiled else _chunk_rows(V)
    return [(slice(s, s + step), compiled and min(step, M - s) > 1) for s in range(0, M, step)]


class _LinearLogprobs(torch.autograd.Function):
    """logp[i] = log_softmax(hidden[i] @ weight.T / temperature)[targets[i]], plus the
    (non-differentiable) entropy when asked. hidden [M, H], weight [V, H], same dtype."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                with_entropy: bool, compiled: bool) -> tuple[Tensor, Tensor]:
        logits = F.linear(hidden, weight)
        M, V = logits.shape
        acc = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for checks
        lse = torch.empty(M, dtype=acc, device=logits.device)
        entropy = torch.zeros(M if with_entropy else 0, dtype=acc, device=logits.device)
        for sl, fast in _row_chunks(M, V, compiled):
            lse[sl], ent = _kernels(fast)[0](logits[sl], temperature, with_entropy)
            if with_entropy:
                entropy[sl] = ent
        target = logits.gather(1, targets[:, None]).squeeze(1).to(acc) / temperature
        ctx.save_for_backward(hidden, weight, targets, logits, lse)
        ctx.temperature, ctx.compiled = temperature, compiled
        ctx.mark_non_differentiable(entropy)
        return target - lse, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, _grad_entropy: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, logits, lse = ctx.saved_tensors
        g = grad_logp.to(lse.dtype)
        M, V = logits.shape
        # built chunk by chunk in the compute dtype (the saved logits stay intact, so
        # retain_graph / gradcheck work)
        grad_logits = torch.empty_like(logits)
        for sl, fast in _row_chunks(M, V, ctx.compiled):
            _kernels(fast)[1](grad_logits[sl], logits[sl], lse[sl], targets[sl], g[sl], ctx.temperature)
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None


def linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, temperature: float = 1.0,
                    dtype: torch.dtype | None = None, with_entropy: bool = False,
                    compiled: bool = False) -> tuple[Tensor, Tensor | None]:
    """(log-probs [M] float32, entropy [M] or None) of ``targets`` under hidden @ weight.T.
    ``compiled``: the log-softmax arithmetic under torch.compile (see ``_kernels``)."""
    dtype = dtype or hidden.dtype
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        logp, ent = _LinearLogprobs.apply(hidden.to(dtype), weight.to(dtype), targets, temperature, with_entropy,
                                          compiled)
    return logp, (ent if with_entropy else None)


def _plain(model: torch.nn.Module, h: Tensor, targets: Tensor, temperature: float,
           entropy: str) -> tuple[Tensor, Tensor | None]:
    logits = model.lm_head(h).float()
    logp = token_logprobs(logits, targets, temperature)
    if entropy == "none":
        return logp, None
    if entropy == "grad" and torch.is_grad_enabled():
        lsm = torch.log_softmax(logits / temperature, dim=-1)
        return logp, -(lsm.exp() * lsm).sum(-1)
    ent = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    step = _chunk_rows(logits.shape[-1])
    with torch.no_grad():  # metric only: chunked so no extra full-size float32 tensors
        for s in range(0, logits.shape[0], step):
            lsm = torch.log_softmax(logits[s : s + step] / temperature, dim=-1)
            ent[s : s + step] = -(lsm.exp() * lsm).sum(-1)
    return logp, ent


def unpads(mb: TokenBatch, routing: Tensor | None, compiled: bool) -> bool:
    """Whether the forward runs on the real tokens only (``UnpaddedAttention``): on the CPU,
    where a per-token op costs in proportion to its tokens, pads included, and RL's
    long-tailed batches leave padding in every micro-batch the plan cuts. Not with replayed
    routing (its [n, L] layout), in ``--true-on-policy`` (the engine's kernels run the padded
    layout), nor compiled (its warm-up shapes are the padded ones); on a GPU the padded step
    is launch-bound."""
    return (mb.input_ids.device.type == "cpu" and routing is None and not compiled
            and not invariant.on(mb.input_ids) and mb.size > 1)


def response_logprobs(
    model: torch.nn.Module,
    mb: TokenBatch,
    *,
    temperature: float,
    dtype: torch.dtype,
    entropy: str = "none",
    routing: Tensor | None = None,
    fused: bool = True,
    compiled: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(logp, entropy) as [n, R] float32 tensors, 0 on padding.

    ``entropy``: "none", "metric" (no gradient) or "grad" (for the entropy bonus).
    ``routing``: [n, L, L_moe, k] expert ids for every input position (routing replay).
    ``compiled``: the fused path's log-softmax under torch.compile (the compiled trainer's).
    """
    device = mb.input_ids.device
    autocast = torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32)
    rows, cols, pos = mb.response_positions()
    if unpads(mb, routing, compiled):
        index, positions, pred, grid = mb.packed_positions()
        B, L = mb.input_ids.shape
        if L > model.rotary.length:  # as the model's own forward grows it for a full pass
            model.rotary.reserve(L, device)
        with autocast:
            out = model(mb.input_ids.reshape(-1).index_select(0, index)[None], positions[None],
                        kv_cache=UnpaddedAttention(index, grid, B, L), return_logits=False,
                        return_hidden=True, check_inputs=False)
        h = out.hidden[0, pred]
    else:
        with autocast:
            out = model(mb.input_ids, routing=routing, return_logits=False, return_hidden=True,
                        check_inputs=False)
        h = out.hidden[rows, pos]
    targets = mb.response_ids[rows, cols]
    if invariant.on(mb.input_ids):
        fused = False  # the LM head and log-softmax as the engine runs them (the mode's kernels)
    if fused and entropy != "grad":
        logp_flat, ent_flat = linear_logprobs(h, model.lm_head.weight, targets, temperature=temperature,
                                              dtype=dtype, with_entropy=entropy == "metric",
                                              compiled=compiled)
    else:
        with autocast:
            logp_flat, ent_flat = _plain(model, h, targets, temperature, entropy)
    shape = mb.response_ids.shape
    logp = torch.zeros(shape, dtype=torch.float32, device=device)
    logp = logp.index_put((rows, cols), logp_flat.float())
    ent = None
    if ent_flat is not None:
        ent = torch.zeros(shape, dtype=torch.float32, device=device).index_put((rows, cols), ent_flat.float())
    return logp, ent


@torch.no_grad()
def full_routing(model: torch.nn.Module, mb: TokenBatch, dtype: torch.dtype) -> Tensor:
    """Routing for every input position of ``mb``: the model's own choice for prompt
    positions, the recorded one at the positions that produced response tokens (P + j − 1).

    The model takes replayed ids for all positions or none, so the prompt's routing comes
    from a forward pass without replay (prompt positions precede every replayed one, so
    they route the same way in the training pass)."""
    assert mb.routing is not None
    device = mb.input_ids.device
    with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
        own = model(mb.input_ids, return_logits=False, return_routing=True, check_inputs=False).routing
    rows, cols, pos = mb.response_positions()
    return own.index_put((rows, pos), mb.routing[rows, cols])
