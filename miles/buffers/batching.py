"""``ReplayBuffer.get_batch``'s work: pick whole ready groups within the staleness bound,
apply the stale policy to the ones that are not, and record the batch's staleness.

Split out of ``replay.py`` only to keep files readable; it operates on the buffer's
internals and is not used on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.buffers.records import READY, Group
from miles.scheduler.staleness import mask_stale, staleness_keys, within_bound
from miles.types import Trajectory

if TYPE_CHECKING:  # core imports this module
    from miles.buffers.core import BufferCore


def take_batch(buf: BufferCore, num_groups: int, trainer_version: int) -> list[list[Trajectory]]:
    cfg = buf.config
    eta, policy = cfg.max_staleness, cfg.stale_policy
    chosen: list[Group] = []
    stale: list[Group] = []
    # The sampling policy may be lazy over the ready dict: do not change it while iterating.
    for group in buf.sampling_policy(buf._ready.values()):
        if policy == "mask" or within_bound(group.oldest_version, trainer_version, eta):
            chosen.append(group)
            if len(chosen) == num_groups:
                break
        else:
            stale.append(group)
    for group in stale:
        if policy == "drop":
            buf._drop_group(group, "stale")
        else:  # recompute: only the members that are too old
            for rec in group.members:
                if rec.state is not None and not within_bound(rec.oldest, trainer_version, eta):
                    buf._recompute(rec)
    if len(chosen) < num_groups:
        buf._notify()
        return []
    batch = _train(buf, chosen, trainer_version)
    buf._notify()
    return batch


def _train(buf: BufferCore, groups: list[Group], trainer_version: int) -> list[list[Trajectory]]:
    """Hand the groups out: they leave the buffer as trained; record their staleness."""
    eta, mask = buf.config.max_staleness, buf.config.stale_policy == "mask"
    recs, ready, held = buf._recs, buf._ready, buf._groups
    hist = dict.fromkeys(staleness_keys(eta), 0)
    n_tokens = stale_sum = worst_max = n_trajs = masked = 0
    batch = []
    for group in groups:
        del ready[group.group_id]
        del held[group.group_id]
        trajs = []
        for rec in group.members:
            traj = rec.traj
            if mask and not within_bound(rec.oldest, trainer_version, eta):
                n, (rec.oldest, rec.n_loss, rec.vsum) = mask_stale(
                    traj, trainer_version, eta, (rec.oldest, rec.n_loss, rec.vsum), rec.runs)
                rec.runs = None
                masked += n
            if rec.n_loss:
                n_tokens += rec.n_loss
                stale_sum += trainer_version * rec.n_loss - rec.vsum
                worst = trainer_version - rec.oldest  # type: ignore[operator]
                hist[worst] = hist.get(worst, 0) + 1
                worst_max = max(worst_max, worst)
            rec.state = None
            del recs[traj.id]
            trajs.append(traj)
        n_trajs += len(trajs)
        batch.append(trajs)
    buf._count[READY] -= n_trajs
    ev = buf._ev
    ev["trained"] += n_trajs
    ev["groups_trained"] += len(groups)
    ev["masked_tokens"] += masked
    last = batch_stats(hist, n_tokens, stale_sum, worst_max, masked)
    buf._last_batch = last
    return batch


def batch_stats(
    hist: dict[int, int], n_tokens: int, stale_sum: int, worst_max: int, masked: int
) -> dict[str, float]:
    """The last batch's metrics: token-mean and worst staleness, a per-trajectory histogram
    of worst staleness (``buffer/staleness_hist/<k>``), and tokens masked for it."""
    last = {
        "buffer/staleness_mean": stale_sum / n_tokens if n_tokens else 0.0,
        "buffer/staleness_max": float(worst_max),
        "buffer/batch_masked_tokens": float(masked),
    }
    last.update({f"buffer/staleness_hist/{k}": float(v) for k, v in sorted(hist.items())})
    return last
