"""What every token mixer shares: separate q, k, v projections, the optional short convolution,
head split and merge, input and state checks, and ``forward``; a mixer implements ``_mix``."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from .._validate import nonnegative_int, positive_int
from .conv import ShortConvolution, init_jointly_, short_convolutions

__all__ = ["Mixer", "ConvState", "KVState", "state_nbytes", "check_recurrent_state"]


def state_nbytes(state) -> int:
    """Bytes held by a mixer state: a tensor, ``None``, or a (nested) tuple/list of them.

    Measured from the tensors themselves (``numel × element_size``), not from a formula, so a
    chapter can set it against the formula (``state_numel``) and against sequence length.
    """
    if state is None:
        return 0
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, (tuple, list)):
        return sum(state_nbytes(s) for s in state)
    raise TypeError(f"a state is a tensor, None or a tuple/list of them, got {type(state).__name__}")


class ConvState(NamedTuple):
    """The short convolutions' states: the last ``K − 1`` projected q, k and v, each
    ``[B, d, K − 1]`` (:class:`~tinyk3.layers.ShortConvolution`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class KVState(NamedTuple):
    """A softmax attention layer's state (SoftmaxAttention, GatedAttention): every past
    token's keys and values, each ``[B, H, T_seen, D]`` (the KV cache), and the convolution
    state (``None`` without one)."""

    k: torch.Tensor
    v: torch.Tensor
    conv: ConvState | None = None


def check_recurrent_state(state, cls: type, S_shape: tuple, x: torch.Tensor, name: str):
    """``(S, conv)`` of a state this layer returned (``None``: a new sequence), else a clear error."""
    if state is None:
        return None, None
    if not isinstance(state, cls):
        raise TypeError(f"{name}: the state must be the {cls.__name__} this layer returned, "
                        f"got {type(state).__name__}")
    S, conv = state.S, state.conv
    if not isinstance(S, torch.Tensor) or tuple(S.shape) != tuple(S_shape):
        raise ValueError(f"{name}: state.S must be [B, HV, Dk, Dv] = {list(S_shape)}, got "
                         f"{list(getattr(S, 'shape', [])) or type(S).__name__}")
    if S.device != x.device:
        raise ValueError(f"{name}: state.S is on {S.device}, x on {x.device}")
    if not isinstance(conv, ConvState):
        raise TypeError(f"{name}: state.conv must be the ConvState this layer returned, "
                        f"got {type(conv).__name__}")
    return S, conv


class Mixer(nn.Module):
    """Base of the token mixers: ``y, new_state = mixer(x, state=None)``, ``x, y: [B, T, d]``.

    Parameters: ``q_proj``, ``k_proj``, ``v_proj`` (each ``d → d`` with a bias), ``o_proj``
    (``d → d``, back to the residual stream) and, with ``conv_size = K > 0``, ``q_conv``,
    ``k_conv``, ``v_conv`` (:class:`~tinyk3.layers.ShortConvolution`, ``K`` taps, SiLU). The
    three input projections are separate tensors and run as three products, so a checkpoint
    that stores them separately maps one to one (GPT-2's fused ``c_attn`` is split on loading).

    A subclass sets ``State`` (a ``NamedTuple`` whose last field is ``conv``, a
    :class:`ConvState` or ``None``) and implements ``_mix(q, k, v, x, state) -> (y, fields)``,
    ``fields`` being the new state's fields before ``conv``. The state passed in is never
    modified; a new one is returned.
    """

    State: type = tuple  # set by each subclass

    def __init__(self, d_model: int, n_head: int, conv_size: int = 0):
        super().__init__()
        name = type(self).__name__
        d_model = positive_int(d_model, "d_model", name)
        n_head = positive_int(n_head, "n_head", name)
        if d_model % n_head:
            raise ValueError(f"{name}: d_model ({d_model}) must be divisible by n_head ({n_head})")
        try:
            conv_size = nonnegative_int(conv_size, "conv_size", name)
        except ValueError:
            raise ValueError(f"{name}: conv_size must be an int >= 0, got {conv_size!r}") from None
        self.d_model, self.n_head, self.head_dim = d_model, n_head, d_model // n_head
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.o_proj = nn.Linear(d_model, d_model)  # output projection, back to the residual
        self.conv_size = conv_size
        if conv_size:  # one filter of conv_size taps per channel of q, k and v (depthwise)
            self.q_conv = ShortConvolution(d_model, conv_size, init=False)
            self.k_conv = ShortConvolution(d_model, conv_size, init=False)
            self.v_conv = ShortConvolution(d_model, conv_size, init=False)
            init_jointly_([self.q_conv, self.k_conv, self.v_conv])  # as one [3d, 1, K] filter

    def qkv_heads(self) -> dict[str, int]:
        """The projections split by head (Per-Head Muon, :func:`tinyk3.optim.per_head_projections`)."""
        return {"q_proj": self.n_head, "k_proj": self.n_head, "v_proj": self.n_head}

    def forward(self, x: torch.Tensor, state=None):
        """``x [B, T, d]`` and the state returned by the previous call → ``(y [B, T, d], new_state)``."""
        self._check_x(x)
        if state is not None and not isinstance(state, self.State):
            raise TypeError(f"{type(self).__name__}: the state must be the {self.State.__name__} "
                            f"this layer returned, got {type(state).__name__}")
        conv_state = None if state is None else state.conv
        q, k, v, new_conv = self.qkv(x, conv_state)  # [B, H, T, D] each
        y, fields = self._mix(q, k, v, x, state)  # y: [B, H, T, D]
        return self._merge(y), self.State(*fields, new_conv)

    def _mix(self, q, k, v, x, state):  # pragma: no cover - every mixer overrides it
        raise NotImplementedError

    def _check_x(self, x: torch.Tensor) -> None:
        name = type(self).__name__
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: x must be a torch.Tensor [B, T, d], got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"{name}: x must have shape [B, T, d={self.d_model}], got {tuple(x.shape)}")
        if x.shape[1] == 0:
            raise ValueError(f"{name}: x has no tokens (T = 0)")

    def project(self, x: torch.Tensor):
        """``x [B, T, d]`` → the projections ``q, k, v``, each ``[B, T, d]`` (no convolution)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def qkv(self, x: torch.Tensor, conv_state: ConvState | None = None):
        """``x [B, T, d]`` → ``q, k, v``, each ``[B, H, T, D]``, and the new convolution state.

        With a short convolution, each of q, k, v goes through its own
        :class:`~tinyk3.layers.ShortConvolution` (SiLU included), continuing from
        ``conv_state``; the three run as one call
        (:func:`~tinyk3.layers.conv.short_convolutions`). Without one, the new convolution
        state is ``None``. Public so that a chapter can read the keys and queries a layer
        forms (before the mixer's feature map or normalisation) from the layer's input.
        """
        B, T, d = x.shape
        H, D = self.n_head, self.head_dim
        if not self.conv_size:
            if conv_state is not None:
                raise ValueError(f"{type(self).__name__}: this layer has no convolution, "
                                 "but the state holds a convolution state")
            q, k, v = self.project(x)  # 3 × [B, T, d]
            new_conv = None
        else:
            if conv_state is not None and not isinstance(conv_state, ConvState):
                raise TypeError(f"{type(self).__name__}: state.conv must be the ConvState this "
                                f"layer returned, got {type(conv_state).__name__}")
            # three products side by side (concatenating the weights into one matrix instead
            # would copy them on every call), then the three convolutions as one
            p = torch.cat(self.project(x), dim=2)  # [B, T, 3d]
            convs = (self.q_conv, self.k_conv, self.v_conv)
            p, states = short_convolutions(convs, p, conv_state)  # each conv on its block
            new_conv = ConvState(*states)
            q, k, v = p.split(d, dim=2)  # 3 × [B, T, d]
        q = q.reshape(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        k = k.reshape(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        v = v.reshape(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        return q, k, v, new_conv

    def _merge(self, y: torch.Tensor) -> torch.Tensor:
        """Heads ``[B, H, T, D]`` → ``[B, T, d]``, then the output projection."""
        B, H, T, D = y.shape
        y = y.transpose(1, 2).contiguous().view(B, T, H * D)  # [B, T, d]
        return self.o_proj(y)

    def state_nbytes(self, state) -> int:
        """Bytes held by ``state`` (see :func:`state_nbytes`)."""
        return state_nbytes(state)

    def _conv_numel(self, batch_size: int) -> int:
        """Numbers in the convolutions' state: ``B · 3d · (K − 1)``."""
        return batch_size * 3 * self.d_model * max(self.conv_size - 1, 0)

    def extra_repr(self) -> str:
        conv = f", conv_size={self.conv_size}" if self.conv_size else ""
        return f"d_model={self.d_model}, n_head={self.n_head}{conv}"
