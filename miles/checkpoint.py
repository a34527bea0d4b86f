"""Checkpoints: everything a run needs to continue exactly, with no pickle anywhere.

A checkpoint is a directory ``DIR/step_000042/`` holding:

- ``trainer.safetensors`` + ``trainer.msgpack``: the trainer's state (model, optimizer, LR
  schedule, RNG) as a tree whose tensors live in safetensors and whose other leaves are
  msgpack — ``save_tree``/``load_tree`` split and join them;
- ``draft.safetensors`` + ``draft.msgpack`` (with ``--enable-draft-training``): the
  DraftTrainer's draft model, optimizer and draft version;
- ``adapter/`` (LoRA runs): ``adapter_config.json`` + ``adapter_model.safetensors``, the
  adapters in PEFT's format, for use outside miles (resume reads ``trainer.*``);
- ``run.msgpack``: the replay buffer (ready groups, partial trajectories, in-flight leases,
  counters), the data cursor, the scheduler's counters and the driver's step;
- ``manifest.json``: step, version, and a SHA-256 of every file, checked on load so that a
  corrupt or truncated checkpoint is refused with a clear message.

Writes are atomic: files go to ``.tmp-step_000042/`` which is renamed into place only once
complete, then ``latest`` is replaced atomically; a crash mid-save leaves the previous
checkpoint as ``latest``. Only the newest ``--keep-checkpoints`` are kept.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors.torch import load_file, save_file

FORMAT = 1
_TENSOR = "__tensor__"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit this run; the message says why."""


# ---- trees of tensors and plain values ----------------------------------------------------


def split_tree(tree: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """Replace every tensor by ``{"__tensor__": key}``, collecting tensors by key."""
    if isinstance(tree, torch.Tensor):
        key = prefix or "root"
        tensors[key] = tree.detach().cpu().contiguous()
        return {_TENSOR: key}
    if isinstance(tree, dict):
        return {str(k): split_tree(v, tensors, f"{prefix}.{k}" if prefix else str(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [split_tree(v, tensors, f"{prefix}.{i}") for i, v in enumerate(tree)]
    return tree


def join_tree(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if set(tree) == {_TENSOR}:
            return tensors[tree[_TENSOR]]
        return {k: join_tree(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join_tree(v, tensors) for v in tree]
    return tree


def save_tree(directory: Path, name: str, tree: Any) -> None:
    tensors: dict[str, torch.Tensor] = {}
    skeleton = split_tree(tree, tensors)
    save_file(tensors, str(directory / f"{name}.safetensors"))
    (directory / f"{name}.msgpack").write_bytes(msgspec.msgpack.encode(skeleton))


def load_tree(directory: Path, name: str) -> Any:
    tensors = load_file(str(directory / f"{name}.safetensors"))
    skeleton = msgspec.msgpack.decode((directory / f"{name}.msgpack").read_bytes())
    return join_tree(skeleton, tensors)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---- checkpoint directories ---------------------------------------------------------------


class CheckpointManager:
    """Atomic writes, a ``latest`` pointer, and retention under one root directory."""

    def __init__(self, root: str | Path, *, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = max(1, keep)
        self.root.mkdir(parents=True, exist_ok=True)

    def begin(self, step: int) -> Path:
        tmp = self.root / f".tmp-step_{step:06d}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int, meta: dict[str, Any]) -> Path:
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"format": FORMAT, "step": step, **meta, "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        _fsync_dir(tmp)
        final = self.root / f"step_{step:06d}"
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer = self.root / ".latest.tmp"
        pointer.write_text(final.name, encoding="utf-8")
        os.replace(pointer, self.root / "latest")
        _fsync_dir(self.root)
        self._retain()
        return final

    def _retain(self) -> None:
        steps = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in steps[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> str | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        return str(self.root / pointer.read_text(encoding="utf-8").strip())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir, or a root holding ``latest``; verified against its manifest."""
    path = Path(path)
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text(encoding="utf-8").strip()
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"--load {path}: not a miles checkpoint (no manifest.json)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"--load {path}: corrupt manifest.json ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"--load {path}: checkpoint format {manifest.get('format')} != {FORMAT}")
    for name, digest in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"--load {path}: missing file {name}")
        if _sha256(file) != digest:
            raise CheckpointError(f"--load {path}: {name} is corrupt (checksum mismatch)")
    return path


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text(encoding="utf-8"))


# ---- the run's state ----------------------------------------------------------------------


async def save_run_state(manager: CheckpointManager, step: int, actors: Any, dataset: Any, scheduler: Any) -> Path:
    """Save trainer, buffer, data cursor and scheduler at ``step`` (driver side)."""
    trainer_state, buffer_state, version = await asyncio.gather(
        actors.trainer.state_dict.remote(), actors.buffer.state_dict.remote(), actors.trainer.get_version.remote()
    )
    draft = getattr(actors, "draft_trainer", None)
    draft_state = await draft.state_dict.remote() if draft is not None else None
    tmp = manager.begin(step)
    await asyncio.to_thread(save_tree, tmp, "trainer", trainer_state)
    # A LoRA run's adapters also in PEFT's format (adapter/), loadable without miles.
    save_adapter = getattr(actors.trainer, "save_adapter", None)
    if save_adapter is not None:
        await save_adapter.remote(str(tmp / "adapter"), getattr(actors, "base_checkpoint", None))
    if draft_state is not None:
        await asyncio.to_thread(save_tree, tmp, "draft", draft_state)
    run_state = {
        "step": step,
        "version": version,
        "buffer": buffer_state,
        "data": dataset.state_dict(),
        "scheduler": scheduler.state_dict(),
    }
    (tmp / "run.msgpack").write_bytes(msgspec.msgpack.encode(run_state))
    return manager.commit(tmp, step, {"version": version})


async def load_run_state(path: str | Path, actors: Any, dataset: Any, scheduler: Any) -> int:
    """Restore a checkpoint into freshly launched actors; returns the step to continue from."""
    ckpt = resolve_checkpoint(path)
    try:
        trainer_state = load_tree(ckpt, "trainer")
        run_state = msgspec.msgpack.decode((ckpt / "run.msgpack").read_bytes())
    except Exception as exc:
        raise CheckpointError(f"--load {ckpt}: cannot read checkpoint ({type(exc).__name__}: {exc})") from None
    try:
        await actors.trainer.load_state_dict.remote(trainer_state)
    except Exception as exc:
        raise CheckpointError(f"--load {ckpt}: trainer state does not fit this model: {exc}") from None
    draft = getattr(actors, "draft_trainer", None)
    if draft is not None and (ckpt / "draft.safetensors").is_file():
        try:
            await draft.load_state_dict.remote(load_tree(ckpt, "draft"))
        except Exception as exc:
            raise CheckpointError(f"--load {ckpt}: draft state does not fit this draft: {exc}") from None
    await actors.buffer.load_state_dict.remote(run_state["buffer"])
    # Generations in flight at the save belonged to workers of the old run: each goes back
    # to the queue exactly once (as PARTIAL with its lease-time prefix, or PENDING).
    await actors.buffer.release_all_workers.remote()
    dataset.load_state_dict(run_state["data"])
    scheduler.load_state_dict(run_state["scheduler"])
    return int(run_state["step"])
