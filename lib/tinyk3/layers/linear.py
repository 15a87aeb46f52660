"""Causal linear attention (Katharopoulos et al., 2020), chapter 3."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from ..ops import feature_maps
from .base import ConvState, Mixer
from .forms import check_form, run_rule
from .registry import MixerSpec, register_mixer

__all__ = ["LinearAttention", "LinearAttentionConfig", "LinearState"]


class LinearState(NamedTuple):
    """A linear-attention layer's state: ``S: [B, H, Dk, Dv]``, ``z: [B, H, Dk]`` (``None``
    when not normalised) and the convolution state (``None`` without one)."""

    S: torch.Tensor
    z: torch.Tensor | None
    conv: ConvState | None = None


class LinearAttention(Mixer):
    """Causal linear attention (Katharopoulos et al., 2020, "Transformers are RNNs"), chapter 3.

    The score ``exp(q·k)`` becomes ``φ(q)·φ(k)`` with a feature map φ applied per head
    (:mod:`tinyk3.ops.feature_maps`; ``"elu+1"`` is the paper's), and the output is

        o_t = φ(q_t) S_t / φ(q_t)·z_t,   S_t = Σ_{j≤t} φ(k_j)ᵀ v_j,   z_t = Σ_{j≤t} φ(k_j)

    (without the denominator if ``normalize=False``). A prompt runs through ``form``
    (:mod:`tinyk3.layers.forms`: by default the parallel form,
    :func:`tinyk3.ops.linear_attention.parallel`; ``"chunked"`` with ``chunk_size``); one new
    token (``T == 1``) through one step of :func:`tinyk3.ops.linear_attention.recurrent`.
    State: :class:`LinearState`
    ``(S, z, conv)``; ``Dk`` is φ's output size (``D`` for the element-wise maps,
    ``1 + D + D²`` for ``"taylor2"``). Fixed size, whatever the length. The ops keep the
    state in float32 (float64 for float64 inputs).

    With ``"taylor2"`` q and k are first scaled by ``D^{-1/4}``, so that
    ``φ(q)·φ(k) ≈ exp(q·k/√D)``, as in softmax attention (the Based architecture's choice);
    the other maps get q and k as projected.
    """

    State = LinearState

    def __init__(self, d_model: int, n_head: int, feature_map: str = "elu+1", normalize: bool = True,
                 eps: float = 1e-6, conv_size: int = 0, form: str = "parallel", chunk_size: int = 64):
        super().__init__(d_model, n_head, conv_size)
        self.form = check_form(form, "linear_attention", type(self).__name__)
        self.chunk_size = chunk_size
        self.phi = feature_maps.get(feature_map)  # ValueError names the choices
        self.feature_map, self.normalize, self.eps = feature_map, bool(normalize), eps
        self.qk_scale = self.head_dim ** -0.25 if feature_map == "taylor2" else 1.0
        self.feature_dim = self.phi(torch.zeros(1, self.head_dim)).shape[-1]  # Dk after φ

    def _mix(self, q, k, v, x, state):
        q = self.phi(q * self.qk_scale)  # φ(q)  [B, H, T, Dk]
        k = self.phi(k * self.qk_scale)  # φ(k)  [B, H, T, Dk]
        initial = None
        if state is not None:
            if self.normalize and state.z is None:
                raise TypeError("LinearAttention: with normalize=True the state holds z; "
                                "this one was made with normalize=False")
            if not self.normalize and state.z is not None:
                raise TypeError("LinearAttention: with normalize=False the state is S alone; "
                                "this one holds z")
            initial = (state.S, state.z) if self.normalize else state.S
        # o_t = φ(q_t) S_t / φ(q_t)·z_t,  S_t = S_{t-1} + φ(k_t)ᵀ v_t,  z_t = z_{t-1} + φ(k_t)
        y, new = run_rule("linear_attention", self.form, q, k, v, chunk_size=self.chunk_size,
                          initial_state=initial, normalize=self.normalize, eps=self.eps)
        return y, (new if self.normalize else (new, None))  # y: [B, H, T, D]

    def state_numel(self, batch_size: int, length: int) -> int:
        """Numbers in the state, for any ``length``: ``B·H·Dk·Dv`` (+ ``B·H·Dk`` for z)."""
        per_head = self.feature_dim * self.head_dim + (self.feature_dim if self.normalize else 0)
        return batch_size * self.n_head * per_head + self._conv_numel(batch_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_map={self.feature_map!r}, normalize={self.normalize}"


@register_mixer
@dataclass(frozen=True)
class LinearAttentionConfig(MixerSpec):
    """A :class:`LinearAttention` layer: ``n_head`` heads, the feature map φ and whether the
    ``φ(q)·z`` denominator is used (Katharopoulos et al., 2020: ELU+1, normalised), and
    ``conv_size`` taps of short convolution on q, k, v (0: none)."""

    n_head: int
    feature_map: str = "elu+1"
    normalize: bool = True
    conv_size: int = 0
    form: str = "parallel"
    chunk_size: int = 64

    kind: ClassVar[str] = "linear"
    module: ClassVar[type] = LinearAttention

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.feature_map not in feature_maps.FEATURE_MAPS:
            raise ValueError(f"unknown feature_map {self.feature_map!r}; choose one of "
                             f"{sorted(feature_maps.FEATURE_MAPS)}")
        if not isinstance(self.normalize, bool):
            raise TypeError(f"LinearAttentionConfig.normalize must be a bool, got {self.normalize!r}")
        check_form(self.form, "linear_attention", type(self).__name__)
