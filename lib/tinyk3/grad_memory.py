"""What a backward pass keeps: the bytes autograd holds between forward and backward (chapter 19).

Autograd saves, for every operation of the forward that needs it, the tensors its backward will
read (``ctx.save_for_backward`` in a custom function, the operands of a matrix product, ...).
They stay alive until the backward has run, so they, not the forward's temporaries, decide how
long a sequence fits in memory for training. :func:`saved_bytes` runs a function under
``torch.autograd.graph.saved_tensors_hooks`` and adds up the distinct storages saved, leaving
out the storages of the inputs themselves (which the caller holds anyway).

Part VI's chapters also share the loss they differentiate, ``⟨o, dO⟩ + ⟨S_T, dS⟩``, whose
gradients with respect to the outputs and the final state are exactly the chosen ``dO`` and
``dS`` (:func:`cotangents`, :func:`autograd_grads`), and what one training step of a language
model keeps under each backward pass (:func:`step_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["Saved", "saved_bytes", "cotangents", "autograd_grads", "step_bytes"]


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


def cotangents(B: int, H: int, T: int, Dk: int, Dv: int, seed: int,
               dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard normal ``dO [B, H, T, Dv]`` and ``dS [B, H, Dk, Dv]`` (drawn in that order from a
    generator seeded with ``seed``): the gradients of the loss ``⟨o, dO⟩ + ⟨S_T, dS⟩`` with
    respect to a rule's outputs and final state."""
    g = torch.Generator().manual_seed(seed)
    dO = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
    dS = torch.randn(B, H, Dk, Dv, generator=g, dtype=dtype)
    return dO, dS


def autograd_grads(fn: Callable, inputs, dO: torch.Tensor, dS: torch.Tensor, **kwargs):
    """Autograd's gradients of ``⟨o, dO⟩ + ⟨S_T, dS⟩`` through ``(o, S_T) = fn(*inputs,
    **kwargs)``, one per input (each input is detached and copied first)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, S = fn(*leaves, **kwargs)
    return torch.autograd.grad((o * dO).sum() + (S * dS).sum(), leaves)


def step_bytes(model, T: int, mode: str) -> int:
    """What one next-token training step of ``model`` (a :class:`tinyk3.models.LM`) on a
    random window of ``T`` tokens keeps for its backward pass, with its chunked mixers
    differentiated by ``mode`` (``"derived"`` or ``"autograd"``,
    :func:`tinyk3.ops.chunks.backward_mode`). The window is drawn from torch's global
    generator."""
    import torch.nn.functional as F

    from .ops.chunks import backward_mode

    x = torch.randint(0, model.config.vocab_size, (1, T + 1))

    def loss(idx):
        logits = model(idx[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())

    with backward_mode(mode):
        return saved_bytes(loss, x).bytes
