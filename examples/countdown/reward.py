"""Reward for the counting task: 1.0 when the response is exactly the numbers a..b, else 0.0.

Loaded by the runtime as ``--custom-rm-path examples/count/reward.py:reward``; the sample is
the trajectory (``.prompt``, ``.response`` decoded text, ``.label``, ``.metadata``), as in
slime. Whitespace is not scored: ``" 3 4 5"`` and ``"3 4 5\\n"`` both match label ``"3 4 5"``.
A binary reward keeps ``eval/pass@k`` meaningful (a sample passes when its reward is > 0).
Self-contained on purpose: the runtime loads this file by path, outside any package.
"""

from __future__ import annotations

from typing import Any


def reward(sample: Any) -> float:
    return 1.0 if sample.response.split() == str(sample.label).split() else 0.0
