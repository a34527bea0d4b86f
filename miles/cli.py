"""The ``miles`` command: ``train``, ``plot``, ``inspect``, ``serve``.

Every failure a user can cause (a bad flag, a missing file, malformed YAML, bad data) ends
with one line naming the problem on stderr and exit status 2 — no traceback, and no output
directory that looks like a finished run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: miles {train,plot,inspect,serve} ...

  miles train --config FILE.yaml [--flag value ...]   run RL (see README.md for flags)
  miles plot OUTPUT_DIR                              draw reward/throughput/staleness PNGs
  miles inspect FILE.jsonl|OUTPUT_DIR [--limit N]    read a trajectory dump
  miles serve --hf-checkpoint DIR [--port N]         an HTTP rollout engine (SGLang protocol)
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    try:
        if command == "train":
            return _train(rest)
        if command == "plot":
            from miles.plot import main as plot_main

            return plot_main(rest)
        if command == "inspect":
            from miles.inspect_dump import main as inspect_main

            return inspect_main(rest)
        if command == "serve":
            from miles.serve import main as serve_main

            return serve_main(rest)
    except KeyboardInterrupt:
        return 130
    except UserError as exc:
        print(f"miles {command}: error: {exc}", file=sys.stderr)
        return 2
    print(f"miles: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


class UserError(Exception):
    """Raised (or mapped to) for problems the user can fix; printed as one line."""


def _train(argv: list[str]) -> int:
    from miles.checkpoint import CheckpointError
    from miles.config import ConfigError, parse_args
    from miles.data import DataError
    from miles.driver import RunFailed, train
    from miles.models import CheckpointError as ModelCheckpointError
    from miles.utils import aio, gcpolicy
    from miles.utils.loading import LoadError
    from miles.validation import notes

    user_errors = (ConfigError, DataError, CheckpointError, ModelCheckpointError, LoadError, FileNotFoundError)
    try:
        cfg = parse_args(argv)
        for note in notes(cfg):
            print(f"miles train: note: {note}", file=sys.stderr)
        gcpolicy.install()  # the driver holds each batch too: its full GC passes on a clock
        summary = aio.run(train(cfg))  # on uvloop where installed
    except user_errors as exc:
        raise UserError(str(exc)) from None
    except RunFailed as exc:
        print(f"miles train: the run failed: {exc}", file=sys.stderr)
        return 1
    status = summary.get("status")
    print(f"miles train: {status} after {summary.get('steps')} steps; outputs in {cfg.run.output_dir}")
    return 0 if status == "completed" else 1
