"""Fixtures of the backend tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def prepared_cache():
    """A module's prepared layers (one at a time: a new key clears it), freed at its end."""
    cache = {}
    yield cache
    cache.clear()
    torch.cuda.empty_cache()
