"""Test markers that several test files share."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import pytest


def real_compile(test: Callable[..., Any]) -> Callable[..., Any]:
    """A test that runs a real inductor compile on the CPU: minutes long, so slow and run only
    with MILES_COMPILE_TESTS=1, and only where a C++ compiler is installed."""
    marks = (
        pytest.mark.slow,
        pytest.mark.skipif(os.environ.get("MILES_COMPILE_TESTS") != "1",
                           reason="a real inductor compile on the CPU takes minutes: MILES_COMPILE_TESTS=1 runs it"),
        pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                           reason="inductor on the CPU needs a C++ compiler"),
    )
    for mark in reversed(marks):
        test = mark(test)
    return test
