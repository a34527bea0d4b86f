from __future__ import annotations

import pytest

from miles.models import Tokenizer, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return build_tiny_tokenizer()


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def overlap(request) -> bool:
    """Run a test with and without the overlapped (launch-ahead) decode schedule."""
    return request.param
