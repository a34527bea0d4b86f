"""Checks that the engine's and the trainer's compile-child tests share."""

from __future__ import annotations

import time

import pytest

from miles.utils.compile_child import BackgroundCompile


def expect_failed_child_reported(child: BackgroundCompile, caplog: pytest.LogCaptureFixture) -> None:
    """A child that fails for want of CUDA exits, is reported with the tail of its log (which
    names CUDA) as a fallback to compiling in-process, and leaves no directory once stopped."""
    deadline = time.monotonic() + 120
    while not child.done():
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.2)
    assert child.seconds > 0
    with caplog.at_level("WARNING"):
        assert not child.ok()
    assert "compiling in-process instead" in caplog.text and "CUDA" in caplog.text
    child.stop()
    assert not child.dir.exists()
