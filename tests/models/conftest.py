"""Shared fixtures of the model tests."""

from __future__ import annotations

import random

import pytest
import torch


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (random inputs every run), printed so a failure can be replayed;
    `random` drives the document generators, torch the tensors."""
    s = random.SystemRandom().randrange(2**31)
    random.seed(s)
    torch.manual_seed(s)
    print(f"seed={s}")
    return s
