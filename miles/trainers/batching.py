"""Trajectories → padded token tensors, and the micro-batch plan.

Layout: each sequence is ``prompt_tokens + response_tokens``, right-padded with token 0.
Right padding needs no attention mask — under causal attention real tokens never see the
pads after them — so the model runs its plain causal (flash-capable) attention path.
Response token j of row n sits at input position P_n + j and is predicted by the logits at
position P_n + j − 1, so every sequence needs a non-empty prompt.

Per-token tensors are response-aligned, [N, R] with R the longest response: response ids,
loss mask, behaviour log-probs, versions (and, for routing replay, [N, R, L_moe, k] expert
ids). ``TokenBatch.select`` cuts a micro-batch and trims both paddings to its own longest
row.

Routing-replay convention: ``Trajectory.routed_experts[j]`` is the routing of the forward
position that produced token j (position P + j − 1), i.e. the routing behind the logits the
token was sampled from — the positions whose log-probs carry loss.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from miles.algorithms import LossDenominators
from miles.trainers.config import TrainerConfig
from miles.types import Trajectory, TrajectoryError
from miles.utils.cuts import cut_by_length
from miles.utils.device import to_device


@dataclass
class TokenBatch:
    input_ids: Tensor  # [N, L] long, right-padded with 0
    prompt_lens: Tensor  # [N] long
    response_lens: Tensor  # [N] long
    response_ids: Tensor  # [N, R] long
    loss_mask: Tensor  # [N, R] float32, 0 on padding
    logp_rollout: Tensor  # [N, R] float32, 0 on padding
    versions: Tensor  # [N, R] long
    kv_versions: Tensor  # [N, R] long: the oldest version in the engine's KV cache per token (Trajectory.kv_versions)
    routing: Tensor | None  # [N, R, L_moe, k] long, replayed expert ids
    seq_lens: list[int]  # host copies for planning, and so a step needs no device reads
    resp_lens: list[int]
    loss_tokens: list[int]  # each row's loss-carrying tokens (loss mask > 0)
    prompt_class: list[int] | None = None  # rows with the same prompt tokens share a class (its first row's index)

    @property
    def size(self) -> int:
        return len(self.seq_lens)

    def select(self, rows: Sequence[int]) -> TokenBatch:
        """The sub-batch of ``rows``, trimmed to its own longest sequence and response."""
        idx = to_device(list(rows), torch.long, self.input_ids.device)
        seq = [self.seq_lens[r] for r in rows]
        resp = [self.resp_lens[r] for r in rows]
        L, R = max(seq, default=0), max(resp, default=0)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                v = v.index_select(0, idx)
                if f.name == "input_ids":
                    v = v[:, :L]
                elif v.ndim >= 2:
                    v = v[:, :R]
            out[f.name] = v
        out.update(seq_lens=seq, resp_lens=resp, loss_tokens=[self.loss_tokens[r] for r in rows],
                   prompt_class=None if self.prompt_class is None else [self.prompt_class[r] for r in rows])
        return TokenBatch(**out)

    def plan(self, rows: Sequence[int], config: TrainerConfig) -> list[list[int]]:
        """``rows`` cut into micro-batches under the trainer's limits, at the per-micro-batch
        cost of the batch's device (``plan_micro_batches``, ``micro_batch_cost``). Rows of
        one length keep their prompts together (the cut is stable), so that more of a
        micro-batch's prompts are shared (``packed_positions``)."""
        if self.prompt_class is not None:
            rows = sorted(rows, key=lambda r: self.prompt_class[r])
        return plan_micro_batches(rows, self.seq_lens, micro_batch_size=config.micro_batch_size,
                                  max_tokens=config.max_tokens_per_micro_batch,
                                  cost=micro_batch_cost(self.input_ids.device))

    def denominators(self, rows: Sequence[int]) -> LossDenominators:
        """The loss denominators of the (mini-)batch ``rows``, from the host counts."""
        return LossDenominators(num_tokens=float(sum(self.loss_tokens[r] for r in rows)),
                                num_seqs=float(sum(self.loss_tokens[r] > 0 for r in rows)),
                                max_tokens=self.loss_mask.shape[1])

    def response_positions(self) -> tuple[Tensor, Tensor, Tensor]:
        """(rows, cols, positions) of every real response token: [n, R] index (rows, cols)
        and the input position whose logits predict it (P + col − 1)."""
        # built from the host lengths: a device ``nonzero`` would wait for the GPU's queue
        resp = np.asarray(self.resp_lens, dtype=np.int64)
        rows = np.repeat(np.arange(len(resp)), resp)
        cols = np.arange(len(rows)) - np.repeat(np.cumsum(resp) - resp, resp)
        pos = np.repeat(np.asarray(self.seq_lens, dtype=np.int64) - resp, resp) + cols - 1
        dev = self.response_ids.device
        return (to_device(rows, torch.long, dev), to_device(cols, torch.long, dev), to_device(pos, torch.long, dev))

    def packed_positions(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For a forward over the real tokens only, back to back (``miles.models.layers.
        UnpaddedAttention``): the index of every packed token in the flattened [n, L] grid
        (row · L + position), its position, the packed index of each real response token's
        predicting position (in ``response_positions`` order), and for every grid cell the
        packed token it holds (the packed count for a pad). From the host lengths.

        When the batch records prompt classes (``build_batch(share_prompts=True)``), a row
        whose prompt an earlier row of the batch has (the samples of a GRPO group) packs its
        response tokens only and reads the prompt's from that row. Under causal attention a
        prompt token sees only the prompt, so its hidden states are the same in every such
        row: the prompt runs through the layers once, and its gradient is the sum over the
        rows that read it."""
        seq = np.asarray(self.seq_lens, dtype=np.int64)
        resp = np.asarray(self.resp_lens, dtype=np.int64)
        n, L = len(seq), self.input_ids.shape[1]
        owner = np.arange(n)  # the row whose packed tokens hold each row's prompt
        if self.prompt_class is not None:
            first: dict[int, int] = {}
            owner = np.array([first.setdefault(c, r) for r, c in enumerate(self.prompt_class)], dtype=np.int64)
        skip = np.where(owner == np.arange(n), 0, seq - resp)  # leading positions a row does not pack
        count = seq - skip
        start = np.cumsum(count) - count  # each row's first packed token

        def packed(rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
            src = np.where(positions < skip[rows], owner[rows], rows)
            return start[src] + positions - skip[src]

        cols = _arange_within(count) + np.repeat(skip, count)
        index = np.repeat(np.arange(n) * L, count) + cols
        grid_rows = np.repeat(np.arange(n), seq)
        grid_cols = _arange_within(seq)
        grid = np.full(n * L, int(count.sum()), dtype=np.int64)
        grid[grid_rows * L + grid_cols] = packed(grid_rows, grid_cols)
        pred = packed(np.repeat(np.arange(n), resp), np.repeat(seq - resp - 1, resp) + _arange_within(resp))
        dev = self.input_ids.device
        return tuple(to_device(a, torch.long, dev) for a in (index, cols, pred, grid))  # type: ignore[return-value]


def _arange_within(lens: np.ndarray) -> np.ndarray:
    """0..len-1 for each length, concatenated."""
    return np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)


def trajectories_of(groups: Sequence[Sequence[Trajectory]]) -> tuple[list[Trajectory], list[int]]:
    """Flatten groups into (trajectories, group index per trajectory)."""
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError("train_step needs a non-empty sequence of non-empty groups")
    trajs = [t for g in groups for t in g]
    index = [i for i, g in enumerate(groups) for _ in g]
    return trajs, index


def rewards_of(trajs: Sequence[Trajectory], reward_key: str | None) -> Tensor:
    """One float32 reward per trajectory (``reward_key`` picks from a dict reward); a
    non-finite one raises before anything is trained."""
    rewards = torch.tensor([t.scalar_reward(reward_key) for t in trajs], dtype=torch.float32)
    if not torch.isfinite(rewards).all():
        raise ValueError("a trajectory has a non-finite reward")
    return rewards


def _padded(rows: Sequence[Sequence[float | int]], lens: Sequence[int], width: int, dtype: torch.dtype) -> Tensor:
    """[N, width] zero-padded from ragged rows, converting only the real entries: in a
    long-tailed batch the padded rectangle is mostly padding (256 rows padded to 2048 for
    ~20k real tokens), and building it from Python lists is host time before the step's
    first kernel. The real entries go through ``np.fromiter``, several times faster than
    ``torch.tensor`` on a list."""
    out = torch.zeros(len(rows), width, dtype=dtype)
    np_dtype = {torch.long: np.int64, torch.float32: np.float32}[dtype]
    flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(rows), dtype=np_dtype, count=sum(lens)))
    out[torch.arange(width)[None, :] < torch.tensor(lens)[:, None]] = flat  # row-major: rows in order
    return out


def build_batch(
    trajs: Sequence[Trajectory],
    *,
    device: torch.device | str,
    vocab_size: int,
    routing_shape: tuple[int, int] | None = None,
    current_version: int | None = None,
    share_prompts: bool = False,
) -> TokenBatch:
    """Validate ``trajs`` and pad them into a TokenBatch (see the module docstring).
    ``share_prompts``: record each row's prompt class, for a forward that packs a prompt
    once per micro-batch (``TokenBatch.packed_positions``).

    ``routing_shape`` = (moe layers, top-k) asks for replayed routing, which every
    trajectory must then carry. Raises TrajectoryError / ValueError naming the trajectory.
    """
    if not trajs:
        raise ValueError("no trajectories")
    for t in trajs:
        t.validate(current_version=current_version)
        if not t.prompt_tokens:
            raise TrajectoryError("prompt_tokens", f"trajectory {t.id} has an empty prompt")
        ids = t.prompt_tokens + t.response_tokens
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise TrajectoryError("tokens", f"trajectory {t.id} has a token id outside [0, {vocab_size})")
        if routing_shape is not None and t.routed_experts is None and t.response_tokens:
            raise TrajectoryError("routed_experts", f"routing replay is on but trajectory {t.id} has none")
    seq_lens = [len(t.prompt_tokens) + len(t.response_tokens) for t in trajs]
    resp_lens = [len(t.response_tokens) for t in trajs]
    N, L, R = len(trajs), max(seq_lens), max(resp_lens)

    dev = torch.device(device)
    lp = _padded([t.logprobs for t in trajs], resp_lens, R, torch.float32)
    mask = _padded([t.loss_mask for t in trajs], resp_lens, R, torch.float32)
    bad = (mask > 0) & ~torch.isfinite(lp)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise TrajectoryError("logprobs", f"trajectory {trajs[row].id} has non-finite behaviour log-probs")
    routing = None
    if routing_shape is not None:
        layers, k = routing_shape
        rows = [t.routed_experts or [] for t in trajs]
        routing = torch.zeros(N, R, layers, k, dtype=torch.long)
        for n, r in enumerate(rows):
            if r:
                got = torch.tensor(r, dtype=torch.long)
                if got.shape != (len(r), layers, k):
                    raise TrajectoryError(
                        "routed_experts", f"trajectory {trajs[n].id}: shape {tuple(got.shape)}, "
                        f"expected ({len(r)}, {layers}, {k})")
                routing[n, : len(r)] = got
        routing = routing.to(dev)
    return TokenBatch(
        input_ids=_padded([t.prompt_tokens + t.response_tokens for t in trajs], seq_lens, L, torch.long).to(dev),
        prompt_lens=torch.tensor([len(t.prompt_tokens) for t in trajs], dtype=torch.long, device=dev),
        response_lens=torch.tensor(resp_lens, dtype=torch.long, device=dev),
        response_ids=_padded([t.response_tokens for t in trajs], resp_lens, R, torch.long).to(dev),
        loss_mask=mask.to(dev),
        logp_rollout=lp.to(dev),
        versions=_padded([t.versions for t in trajs], resp_lens, R, torch.long).to(dev),
        kv_versions=_padded([t.kv_versions if len(t.kv_versions) == len(t.versions) else t.versions for t in trajs],
                            resp_lens, R, torch.long).to(dev),
        routing=routing,
        seq_lens=seq_lens,
        resp_lens=resp_lens,
        loss_tokens=[t.loss_mask.count(1) for t in trajs],  # validated: 0 or 1
        prompt_class=prompt_classes(trajs) if share_prompts else None,
    )


def prompt_classes(trajs: Sequence[Trajectory]) -> list[int]:
    """Each trajectory's prompt class: the index of the first trajectory with the same
    prompt tokens."""
    first: dict[tuple[int, ...], int] = {}
    return [first.setdefault(tuple(t.prompt_tokens), i) for i, t in enumerate(trajs)]


# What one more micro-batch costs, in padded tokens' worth: its fixed work (a forward and a
# backward's kernel launches and Python) against the padding a split saves. On the CPU the
# compute dominates: ~1k tokens. On a GPU the host's work per micro-batch (thousands of
# kernel launches for a 0.5B shape) is worth ~8k tokens of device time (torch.profiler in
# benchmarks/trainer_long_tail.py --profile); with the CPU's figure a GPU step splits into
# too many micro-batches and runs slower than the greedy plan.
MICRO_BATCH_COST = {"cpu": 1024, "cuda": 8192}


def micro_batch_cost(device: torch.device | str) -> int:
    return MICRO_BATCH_COST.get(torch.device(device).type, MICRO_BATCH_COST["cuda"])


def plan_micro_batches(
    rows: Sequence[int],
    seq_lens: Sequence[int],
    *,
    micro_batch_size: int | None,
    max_tokens: int | None,
    cost: int = MICRO_BATCH_COST["cpu"],
) -> list[list[int]]:
    """Split ``rows`` into micro-batches of at most ``micro_batch_size`` rows and at most
    ``max_tokens`` padded tokens (rows × longest row); a single row longer than
    ``max_tokens`` still gets a micro-batch of its own. The cut is ``miles.utils.cuts``':
    longest first, where padded tokens + ``cost`` per micro-batch are least. Filling each
    micro-batch greedily up to the limits, as before, padded dozens of short rows to a long
    one in RL's long-tailed batches: 65% of the tokens of a 256-sample Zipf batch at 32k
    tokens per micro-batch were padding; cut this way, 16-19%."""
    return cut_by_length(rows, seq_lens, max_rows=micro_batch_size, max_tokens=max_tokens, cost=cost)
