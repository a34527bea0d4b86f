"""What a run writes to ``--output-dir``.

- ``config.yaml``: the resolved config, written before anything runs;
- ``metrics.jsonl``: one line per train step (through the one ``MetricsRecorder``);
- ``trajectories.jsonl`` (``--dump-trajectories``): every trained trajectory, one per line;
- ``eval.jsonl``: one line per evaluation;
- ``summary.json``: the accounting ledger and how the run ended — written last, so an output
  directory without it is not a finished run;
- ``--save-debug-rollout-data DIR``: each step's batch as msgpack, replayable into the
  trainer alone with ``--load-debug-rollout-data DIR`` (as slime's).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from miles.config import MilesConfig
from miles.metrics import MetricsRecorder
from miles.types import Trajectory

_batch_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(list[list[Trajectory]])


class RunOutputs:
    def __init__(self, cfg: MilesConfig) -> None:
        self.dir = Path(cfg.run.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        stale = self.dir / "summary.json"
        if stale.exists():  # a previous run's summary must not describe this one
            stale.unlink()
        cfg.dump(self.dir / "config.yaml")
        self.metrics = MetricsRecorder(self.dir, tensorboard=cfg.run.tensorboard)
        self._dump = open(self.dir / "trajectories.jsonl", "a", encoding="utf-8") if cfg.run.dump_trajectories else None
        self._eval = open(self.dir / "eval.jsonl", "a", encoding="utf-8")
        self.debug_dir = Path(cfg.run.save_debug_rollout_data) if cfg.run.save_debug_rollout_data else None
        if self.debug_dir is not None:
            self.debug_dir.mkdir(parents=True, exist_ok=True)
        self._bar: Any = None
        if cfg.run.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=cfg.run.num_rollout, desc="miles", unit="step", file=sys.stderr, dynamic_ncols=True)

    def resumed_at(self, step: int) -> None:
        """A run resumed by --load continues at ``step``: the progress bar starts there."""
        if self._bar is not None:
            self._bar.n = self._bar.initial = step
            self._bar.refresh()

    def dump_batch(self, step: int, trainer_version: int, groups: Sequence[Sequence[Trajectory]]) -> None:
        if self._dump is not None:
            for group in groups:
                for t in group:
                    row = msgspec.to_builtins(t)
                    row["trainer_version"] = trainer_version
                    row["step"] = step
                    row["token_versions"] = row["versions"]
                    row["rollout_logprobs"] = row["logprobs"]
                    row["group"] = row["group_id"]
                    self._dump.write(json.dumps(row) + "\n")
            self._dump.flush()
        if self.debug_dir is not None:
            (self.debug_dir / f"step_{step:06d}.msgpack").write_bytes(_batch_encoder.encode([list(g) for g in groups]))

    def log_step(self, step: int, metrics: Mapping[str, Any], at: float | None = None) -> dict[str, Any]:
        row = self.metrics.log(step, metrics, at)
        if self._bar is not None:
            self._bar.update(1)
            post = {k.split("/")[-1]: round(v, 3) for k, v in row.items()
                    if k in ("rollout/reward_mean", "buffer/staleness_max", "perf/trained_tokens_per_s",
                             "perf/trained_samples_per_s")
                    and isinstance(v, (int, float))}
            self._bar.set_postfix(post)
        return row

    def log_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._eval.write(json.dumps({"step": step, **metrics}) + "\n")
        self._eval.flush()

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        tmp = self.dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
        tmp.replace(self.dir / "summary.json")

    def close(self) -> None:
        self.metrics.close()
        for fh in (self._dump, self._eval):
            if fh is not None:
                fh.close()
        if self._bar is not None:
            self._bar.close()


def load_debug_batches(directory: str | Path) -> list[list[list[Trajectory]]]:
    """Batches saved by ``--save-debug-rollout-data``, in step order."""
    files = sorted(Path(directory).glob("step_*.msgpack"))
    if not files:
        raise FileNotFoundError(f"--load-debug-rollout-data {directory}: no step_*.msgpack files")
    return [_batch_decoder.decode(f.read_bytes()) for f in files]


def batch_metrics(groups: Sequence[Sequence[Trajectory]], trainer_version: int,
                  reward_key: str | None = None) -> dict[str, float]:
    """Reward, length and staleness of one trained batch (staleness on loss tokens only).
    The reward is the one the trainer uses: ``reward_key``'s entry of a dict reward."""
    trajs = [t for g in groups for t in g]
    rewards = [t.scalar_reward(reward_key) for t in trajs if t.reward is not None]
    lengths = [len(t.response_tokens) for t in trajs]
    stale = [trainer_version - v for t in trajs for v, m in zip(t.versions, t.loss_mask) if m]
    spans = [len(set(t.loss_versions())) for t in trajs]
    kv = [kv < v for t in trajs if len(t.kv_versions) == len(t.versions)
          for v, kv, m in zip(t.versions, t.kv_versions, t.loss_mask) if m]
    out = {
        "rollout/reward_mean": statistics.fmean(rewards) if rewards else math.nan,
        "rollout/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "rollout/response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "rollout/response_len_max": float(max(lengths, default=0)),
        "rollout/truncated_frac": sum(t.status == "truncated" for t in trajs) / max(len(trajs), 1),
        "buffer/staleness_mean": statistics.fmean(stale) if stale else 0.0,
        "buffer/staleness_max": float(max(stale, default=0)),
        "rollout/versions_per_traj_max": float(max(spans, default=0)),
        # Loss tokens sampled on a cache still holding an older policy's K/V entries.
        "train/mixed_version_kv_frac": sum(kv) / len(kv) if kv else 0.0,
        "rollout/resumed_frac": sum(t.num_segments > 1 for t in trajs) / max(len(trajs), 1),
        "perf/trained_samples": float(len(trajs)),
        "perf/trained_tokens": float(sum(lengths)),
    }
    return out
