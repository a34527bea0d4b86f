"""``miles inspect FILE.jsonl`` (or ``miles inspect OUTPUT_DIR``): read a trajectory dump as text.

Shows each trajectory's ids, status, reward, the policy versions of its tokens (as runs,
``v3×12 v4×30``), and the decoded prompt and response when a tokenizer is given (or when the
run's config.yaml beside the dump names the checkpoint); environment-written spans are
marked ``[env: ...]``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path
from typing import Any


def version_runs(versions: Sequence[int]) -> str:
    return " ".join(f"v{v}×{len(list(g))}" for v, g in groupby(versions))


def render(row: dict[str, Any], tokenizer: Any = None) -> str:
    versions = row.get("token_versions") or row.get("versions") or []
    mask = row.get("loss_mask") or []
    lines = [
        f"── {row.get('id')}  prompt={row.get('prompt_id')} group={row.get('group', row.get('group_id'))}"
        f"  status={row.get('status')} reward={row.get('reward')} segments={row.get('num_segments')}"
        f"  trainer_version={row.get('trainer_version')}",
        f"   tokens: {len(versions)} response ({sum(mask)} with loss); versions: {version_runs(versions)}",
    ]
    if tokenizer is not None:
        tokens = row.get("response_tokens") or []
        parts = []
        for seg in row.get("segments") or [[0, len(tokens), "model"]]:
            start, end, kind = seg
            text = tokenizer.decode(tokens[start:end])
            parts.append(text if kind == "model" else f"[env: {text}]")
        lines.append("   prompt:   " + tokenizer.decode(row.get("prompt_tokens") or []).replace("\n", "\\n"))
        lines.append("   response: " + "".join(parts).replace("\n", "\\n"))
    elif row.get("response"):
        lines.append("   response: " + str(row["response"]).replace("\n", "\\n"))
    return "\n".join(lines)


def _tokenizer_for(dump: Path, explicit: str | None) -> Any:
    path = explicit
    if path is None:
        config = dump.parent / "config.yaml"
        if config.is_file():
            import yaml

            path = (yaml.safe_load(config.read_text()) or {}).get("rollout", {}).get("hf_checkpoint")
    if not path or not (Path(path) / "tokenizer.json").is_file():
        return None
    from miles.models import load_tokenizer

    return load_tokenizer(path)


def main(argv: Sequence[str]) -> int:
    from miles.cli import UserError

    parser = argparse.ArgumentParser(prog="miles inspect")
    parser.add_argument("dump", help="trajectories.jsonl from --dump-trajectories, or the run's output dir")
    parser.add_argument("--tokenizer", default=None, help="checkpoint dir with tokenizer.json")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--id", default=None, help="only this trajectory id")
    args = parser.parse_args(list(argv))
    dump = Path(args.dump)
    if dump.is_dir():  # a run's --output-dir: its dump, where the run made one
        if not (dump / "trajectories.jsonl").is_file():
            raise UserError(f"{dump}: no trajectories.jsonl in this directory (run with --dump-trajectories)")
        dump = dump / "trajectories.jsonl"
    if not dump.is_file():
        raise UserError(f"{dump}: file not found")
    tokenizer = _tokenizer_for(dump, args.tokenizer)
    shown = 0
    with open(dump, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{dump}:{line_no}: not JSON ({exc})") from None
            if not isinstance(row, dict) or "response_tokens" not in row and "id" not in row:
                raise UserError(f"{dump}:{line_no}: not a trajectory (is this the --dump-trajectories "
                                "file, trajectories.jsonl?)")
            if args.id and row.get("id") != args.id:
                continue
            print(render(row, tokenizer))
            shown += 1
            if shown >= args.limit:
                break
    return 0
