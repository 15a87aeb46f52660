"""DeltaNet: the delta rule as a token mixer (chapter 5)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import ConvState, Mixer
from .forms import check_form, run_rule
from .registry import MixerSpec, register_mixer

__all__ = ["DeltaNet", "DeltaNetConfig", "DeltaState"]


class DeltaState(NamedTuple):
    """A DeltaNet layer's state: ``S: [B, H, Dk, Dv]`` and the convolution state (``None``
    without one)."""

    S: torch.Tensor
    conv: ConvState | None = None


class DeltaNet(Mixer):
    """DeltaNet (Schlag et al., 2021; Yang et al., 2024, "Parallelizing Linear Transformers
    with the Delta Rule over Sequence Length"), chapter 5.

    Per head, q and k are L2-normalised SiLU features, ``F.normalize(F.silu(·))``, the paper's
    choice (fla's ``qk_activation='silu'``, ``qk_norm='l2'``); a write strength
    ``β_t = sigmoid(W_β x_t)`` per head and token (``[B, H, T]``, from ``b_proj``); then
    the delta rule (:mod:`tinyk3.ops.delta_rule`):

        S_t = S_{t-1} + k_tᵀ β_t (v_t − k_t S_{t-1}),   o_t = q_t S_t

    State: :class:`DeltaState` ``(S, conv)``, ``S: [B, H, D, D]``, fixed size. With
    ‖k_t‖ = 1 and β_t ∈ (0, 1) the transition ``I − β_t k_tᵀ k_t`` has eigenvalues 1
    (D − 1 times) and 1 − β_t ∈ (0, 1): it never expands the state, so the state cannot blow
    up the way it does with raw keys (chapter 5).

    ``conv_size`` adds fla's short causal convolution on q, k, v; fla's layer also
    RMS-normalises each head's output (chapter 12).
    ``form`` picks how a prompt (``T > 1``) is computed (:mod:`tinyk3.layers.forms`): by
    default :func:`tinyk3.ops.delta_rule.parallel` (one triangular solve, ``O(T²)`` memory:
    fine for the short sequences of Part II), ``"chunked"`` (chapter 8, ``chunk_size``),
    ``"recurrent"``, or ``"triton"`` (chapter 9's kernel); a single token always takes one step
    of :func:`tinyk3.ops.delta_rule.recurrent`. ``op``, an escape hatch for a function of one's
    own with the contract ``op(q, k, v, beta, *, initial_state) -> (o, S)``, overrides the
    form for every call.
    """

    State = DeltaState

    def __init__(self, d_model: int, n_head: int, op: Callable | None = None, conv_size: int = 0,
                 form: str = "parallel", chunk_size: int = 64):
        super().__init__(d_model, n_head, conv_size)
        self.b_proj = nn.Linear(d_model, n_head)  # one write strength per head and token
        self.op = op
        self.form = check_form(form, "delta_rule", type(self).__name__)
        self.chunk_size = chunk_size

    def _mix(self, q, k, v, x, state):
        # q, k ← SiLU, then unit length per head: ‖k_t‖ = 1 makes each write a projection
        q = F.normalize(F.silu(q), dim=-1)  # [B, H, T, D]
        k = F.normalize(F.silu(k), dim=-1)  # [B, H, T, D]
        # β_t = sigmoid(W_β x_t) ∈ (0, 1), one per head and token
        beta = torch.sigmoid(self.b_proj(x)).transpose(1, 2)  # [B, T, H] -> [B, H, T]
        # S_t = S_{t-1} + k_tᵀ β_t (v_t − k_t S_{t-1}),  o_t = q_t S_t
        S0 = None if state is None else state.S
        if self.op is not None:
            y, S = self.op(q, k, v, beta, initial_state=S0)
        else:
            y, S = run_rule("delta_rule", self.form, q, k, v, beta, chunk_size=self.chunk_size,
                            initial_state=S0)
        return y, (S,)  # y: [B, H, T, D]

    def state_numel(self, batch_size: int, length: int) -> int:
        """Numbers in the state, for any ``length``: ``B·H·D·D``."""
        return batch_size * self.n_head * self.head_dim * self.head_dim + self._conv_numel(batch_size)


@register_mixer
@dataclass(frozen=True)
class DeltaNetConfig(MixerSpec):
    """A :class:`DeltaNet` layer: ``n_head`` heads and ``conv_size`` taps of short
    convolution on q, k, v (0: none; fla's layers use 4)."""

    n_head: int
    conv_size: int = 0
    form: str = "parallel"
    chunk_size: int = 64

    kind: ClassVar[str] = "deltanet"
    module: ClassVar[type] = DeltaNet

    def __post_init__(self) -> None:
        super().__post_init__()
        check_form(self.form, "delta_rule", type(self).__name__)

    def num_parameters(self, d_model: int) -> int:
        """The shared count, plus ``W_β``: ``d·H + H``."""
        return super().num_parameters(d_model) + d_model * self.n_head + self.n_head
