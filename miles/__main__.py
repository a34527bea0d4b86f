"""``python -m miles`` is the ``miles`` command."""

from miles.cli import main

raise SystemExit(main())
