"""The short causal convolution: a depthwise filter over the last few tokens, with its own state.

DeltaNet, Mamba and the Kimi layers put one in front of the mixing, on each of q, k and v
(fla's ``ShortConvolution``; chapter 5 shows that small models need it for associative recall,
chapter 12 studies it). For channel ``c`` and token ``t``, with ``K = kernel_size`` taps:

    y_t[c] = act(b[c] + Σ_{i<K} w[c, i] · x_{t−K+1+i}[c])

Causal: the ``K − 1`` inputs before the first token come from the state (zeros at the start of
a sequence), and the new state is the last ``K − 1`` inputs, ``[B, channels, K − 1]``, so a
sequence fed in pieces gives the outputs of one pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._validate import positive_int

__all__ = ["ShortConvolution", "short_convolutions", "init_jointly_"]

_ACTIVATIONS = {"silu": F.silu, None: None}


class ShortConvolution(nn.Module):
    """Depthwise causal convolution over time on ``x: [B, T, channels]``, then SiLU.

    ``forward(x, state=None) -> (y [B, T, channels], new_state [B, channels, K − 1])``. The
    state passed in is never modified. The weight has ``nn.Conv1d``'s depthwise shape
    ``[channels, 1, K]`` (fla's and Kimi Linear's ``*_conv1d.weight``) and ``nn.Conv1d``'s
    initialisation; ``bias=False`` drops the bias, as those checkpoints do. ``init=False``
    leaves the parameters to the caller (no random draws), as :func:`init_jointly_` needs.
    """

    def __init__(self, channels: int, kernel_size: int, *, bias: bool = True,
                 activation: str | None = "silu", init: bool = True):
        super().__init__()
        self.channels = positive_int(channels, "channels", "ShortConvolution")
        self.kernel_size = positive_int(kernel_size, "kernel_size", "ShortConvolution")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"ShortConvolution: activation must be one of "
                             f"{sorted(map(str, _ACTIVATIONS))}, got {activation!r}")
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None
        if init:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Conv1d``'s default: uniform in ``±1/√K`` (the fan-in of a depthwise filter)."""
        init_depthwise_(self.weight, self.bias)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None):
        B, T, Ch = x.shape
        if Ch != self.channels:
            raise ValueError(f"ShortConvolution: x must be [B, T, {self.channels}], got {tuple(x.shape)}")
        K = self.kernel_size
        xt = x.transpose(1, 2)  # [B, channels, T]
        if state is None:
            past = xt.new_zeros(B, Ch, K - 1)
        else:
            if not isinstance(state, torch.Tensor) or state.shape != (B, Ch, K - 1):
                raise ValueError(f"ShortConvolution: the state must be [B, channels, K-1] = "
                                 f"{[B, Ch, K - 1]}, got {getattr(state, 'shape', state)}")
            past = state
        full = torch.cat([past, xt], dim=2)  # [B, channels, K − 1 + T]
        new_state = full[:, :, full.shape[2] - (K - 1):]  # the last K − 1 inputs
        y = F.conv1d(full, self.weight, self.bias, groups=Ch)  # [B, channels, T]
        act = _ACTIVATIONS[self.activation]
        y = act(y) if act is not None else y
        return y.transpose(1, 2), new_state  # [B, T, channels]

    def state_numel(self, batch_size: int) -> int:
        """Numbers in the state: ``B · channels · (K − 1)``, whatever the length."""
        return batch_size * self.channels * (self.kernel_size - 1)

    def extra_repr(self) -> str:
        return (f"channels={self.channels}, kernel_size={self.kernel_size}, "
                f"bias={self.bias is not None}, activation={self.activation!r}")


def init_depthwise_(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``nn.Conv1d.reset_parameters`` for a depthwise weight ``[channels, 1, K]``, in place."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1] * weight.shape[2])  # 1/√fan_in
        nn.init.uniform_(bias, -bound, bound)


@torch.no_grad()
def init_jointly_(convs: list[ShortConvolution]) -> None:
    """Initialise several convolutions as one over their channels concatenated.

    The draws are those of a single ``nn.Conv1d`` over all channels (the whole weight, then the
    whole bias), split among the modules. The mixers use it for q, k and v, so a model keeps the
    random stream, and so the numbers, of the fused ``[3d, 1, K]`` convolution the library had
    before the projections were separated.
    """
    K = convs[0].kernel_size
    if any(c.kernel_size != K for c in convs):
        raise ValueError("init_jointly_: the convolutions must share kernel_size")
    has_bias = convs[0].bias is not None
    if any((c.bias is not None) != has_bias for c in convs):
        raise ValueError("init_jointly_: either all convolutions have a bias or none")
    total = sum(c.channels for c in convs)
    weight = torch.empty(total, 1, K, dtype=convs[0].weight.dtype)
    bias = torch.empty(total, dtype=weight.dtype) if has_bias else None
    init_depthwise_(weight, bias)
    start = 0
    for c in convs:
        c.weight.copy_(weight[start : start + c.channels])
        if has_bias:
            c.bias.copy_(bias[start : start + c.channels])
        start += c.channels


def short_convolutions(convs, x: torch.Tensor, states=None):
    """Several :class:`ShortConvolution` on consecutive channel blocks of ``x``, as one call.

    ``x: [B, T, Σ channels]`` (for the mixers, q, k and v side by side, as one matmul gives
    them), ``states``: one state per convolution or ``None``. Returns ``y`` of ``x``'s shape
    and the new states, one per convolution: what calling each module on its block gives (to
    rounding), computed by one depthwise convolution over all the channels. The mixers use it
    so that a model's numbers stay, to the bit, those of the fused ``[3d, 1, K]`` convolution
    the library had before the projections were separated.
    """
    convs = list(convs)
    K, act = convs[0].kernel_size, convs[0].activation
    if any(c.kernel_size != K or c.activation != act for c in convs):
        raise ValueError("short_convolutions: the convolutions must share kernel_size and activation")
    sizes = [c.channels for c in convs]
    B, T, Ch = x.shape
    if Ch != sum(sizes):
        raise ValueError(f"short_convolutions: x must be [B, T, {sum(sizes)}], got {tuple(x.shape)}")
    if states is None or all(s is None for s in states):
        past = x.new_zeros(B, Ch, K - 1)
    else:
        for c, s in zip(convs, states, strict=True):
            if not isinstance(s, torch.Tensor) or s.shape != (B, c.channels, K - 1):
                raise ValueError(f"ShortConvolution: the state must be [B, channels, K-1] = "
                                 f"{[B, c.channels, K - 1]}, got {getattr(s, 'shape', s)}")
        past = torch.cat(list(states), dim=1)  # [B, Σ channels, K − 1]
    full = torch.cat([past, x.transpose(1, 2)], dim=2)  # [B, Σ channels, K − 1 + T]
    new_states = full[:, :, full.shape[2] - (K - 1):].split(sizes, dim=1)  # the last K − 1 inputs
    weight = torch.cat([c.weight for c in convs])  # [Σ channels, 1, K]
    bias = None if convs[0].bias is None else torch.cat([c.bias for c in convs])
    y = F.conv1d(full, weight, bias, groups=Ch)  # [B, Σ channels, T]
    fn = _ACTIVATIONS[act]
    y = fn(y) if fn is not None else y
    return y.transpose(1, 2), list(new_states)  # [B, T, Σ channels]
