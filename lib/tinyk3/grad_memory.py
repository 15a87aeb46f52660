"""What a backward pass keeps: the bytes autograd holds between forward and backward (chapter 19).

Autograd saves, for every operation of the forward that needs it, the tensors its backward will
read (``ctx.save_for_backward`` in a custom function, the operands of a matrix product, ...).
They stay alive until the backward has run, so they, not the forward's temporaries, decide how
long a sequence fits in memory for training. :func:`saved_bytes` runs a function under
``torch.autograd.graph.saved_tensors_hooks`` and adds up the distinct storages saved, leaving
out the storages of the inputs themselves (which the caller holds anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["Saved", "saved_bytes"]


class Saved(NamedTuple):
    """What one forward left for its backward."""

    bytes: int  # distinct storages saved, beyond the inputs' own storages
    tensors: int  # how many saved tensors those storages back
    input_bytes: int  # the inputs' own storages, for scale


def saved_bytes(fn: Callable, *inputs) -> Saved:
    """Run ``fn(*inputs)`` (with gradients on) and measure what autograd keeps for the backward.

    Every tensor autograd packs is counted once per storage (views of one storage count once);
    storages of ``inputs`` (tensors among them; other arguments are passed through) are left
    out. The function's outputs are dropped after the measurement.
    """
    own = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    seen: dict[int, int] = {}
    count = 0

    def pack(t: torch.Tensor):
        nonlocal count
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in own:
            count += 1
            seen[ptr] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    del out
    size = sum(t.untyped_storage().nbytes() for t in inputs if isinstance(t, torch.Tensor))
    return Saved(sum(seen.values()), count, size)
