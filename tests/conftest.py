"""Shared settings for the unit tests: one thread, tiny models, nothing downloaded."""

from __future__ import annotations

import os

import pytest
import torch

# The course's tensors are tiny: on a 2-core machine one thread is faster, because waking and
# synchronising a second thread costs more than the work it would share. Respect an explicit
# OMP_NUM_THREADS.
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

# transformers must never reach the network from a test (models are built from configs).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test starts from the same global seed, so a failure reproduces alone."""
    torch.manual_seed(0)
