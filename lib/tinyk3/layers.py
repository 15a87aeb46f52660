"""Token mixers: the layers that let a token read the tokens before it (chapters 1-5).

Every mixer has one interface, so a model can swap them by configuration
(:mod:`tinyk3.models`) and a chapter can compare them on the same model and data:

    y, new_state = mixer(x, state=None)      x, y: [B, T, C]

Each mixer can put a short causal convolution in front of its mixing (``conv_size > 0``:
a depthwise convolution over the last ``conv_size`` tokens on q, k and v, then SiLU, as the
DeltaNet and Kimi layers do; chapter 12 studies it). It lets a token see its neighbours
directly, which small models need to learn associative recall (chapter 5). Its state is the
last ``conv_size − 1`` projected tokens, carried as ``(conv_state, mixer_state)``.

``state`` is everything needed to continue the sequence: run a prompt (prefill) with
``state=None``, then feed the returned state back with one token (decode) or a block of
tokens, and the outputs equal those of one pass over the whole sequence. The state passed
in is never modified; a new one is returned.

* :class:`SoftmaxAttention`: ``softmax(q kᵀ/√D + mask) v``; its state is the KV cache
  ``(k, v)``, each ``[B, H, T, D]``: it grows with every token (chapter 2).
* :class:`LinearAttention`: ``φ(q) S`` with ``S = Σ φ(k)ᵀ v`` (chapter 3); its state is
  ``S: [B, H, Dk, Dv]`` (and ``z: [B, H, Dk]`` when normalised): fixed size.
* :class:`DeltaNet`: the delta rule ``S_t = S_{t-1} + k_tᵀ β_t (v_t − k_t S_{t-1})``
  (chapter 5); state ``S: [B, H, Dk, Dv]``: fixed size.

:func:`state_nbytes` measures any of these states in bytes, and each layer's
``state_numel(batch_size, length)`` gives the same size by formula.

The mixing maths lives in pure functions (:mod:`tinyk3.attention`, :mod:`tinyk3.ops`); these
modules add the projections and the per-head feature maps. Projection names follow GPT-2
(``c_attn`` for q, k, v in one matrix, ``c_proj`` for the output), so a GPT-2 block's weights
load into a :class:`SoftmaxAttention` unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import causal_attention_sdpa
from .ops import delta_rule, feature_maps
from .ops import linear_attention as linear_attention_ops

__all__ = ["SoftmaxAttention", "LinearAttention", "DeltaNet", "state_nbytes", "MIXERS"]


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


class _Mixer(nn.Module):
    """Shared parts: the q, k, v projection (with the optional short convolution), head split
    and merge, input checks, and ``forward``; each mixer implements ``_mix``."""

    def __init__(self, d_model: int, n_head: int, conv_size: int = 0):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_head", n_head)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}: {name} must be a positive int, got {value!r}")
        if isinstance(conv_size, bool) or not isinstance(conv_size, int) or conv_size < 0:
            raise ValueError(f"{type(self).__name__}: conv_size must be an int >= 0, got {conv_size!r}")
        if d_model % n_head:
            raise ValueError(
                f"{type(self).__name__}: d_model ({d_model}) must be divisible by n_head ({n_head})"
            )
        self.d_model, self.n_head, self.head_dim = d_model, n_head, d_model // n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)  # q, k, v in one matmul
        self.c_proj = nn.Linear(d_model, d_model)  # output projection, back to the residual
        self.conv_size = conv_size
        if conv_size:  # one filter of conv_size taps per channel of q, k and v (depthwise)
            self.qkv_conv = nn.Conv1d(3 * d_model, 3 * d_model, conv_size, groups=3 * d_model)

    def forward(self, x: torch.Tensor, state=None):
        """``x [B, T, C]`` and the state returned by the previous call → ``(y [B, T, C], new_state)``."""
        self._check_x(x)
        conv_state, mix_state = self._split_state(state)
        q, k, v, new_conv_state = self._qkv(x, conv_state)  # [B, H, T, D] each
        y, new_mix_state = self._mix(q, k, v, x, mix_state)  # y: [B, H, T, D]
        new_state = (new_conv_state, new_mix_state) if self.conv_size else new_mix_state
        return self._merge(y), new_state

    def _mix(self, q, k, v, x, state):  # pragma: no cover - every mixer overrides it
        raise NotImplementedError

    def _split_state(self, state):
        if not self.conv_size:
            return None, state
        if state is None:
            return None, None
        if not (isinstance(state, (tuple, list)) and len(state) == 2):
            raise TypeError(f"{type(self).__name__}: with conv_size > 0 the state is the pair "
                            "(conv_state, mixer_state) this layer returned")
        return state[0], state[1]

    def _check_x(self, x: torch.Tensor) -> None:
        name = type(self).__name__
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: x must be a torch.Tensor [B, T, C], got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"{name}: x must have shape [B, T, C={self.d_model}], got {tuple(x.shape)}")
        if x.shape[1] == 0:
            raise ValueError(f"{name}: x has no tokens (T = 0)")

    def _qkv(self, x: torch.Tensor, conv_state=None):
        """``x [B, T, C]`` → ``q, k, v``, each ``[B, H, T, D]``, and the new convolution state.

        With a short convolution: ``h_t = SiLU(Σ_{i<K} w_i ⊙ p_{t−i} + b)`` over the projections
        ``p``, causal (the ``K − 1`` inputs before the first token come from ``conv_state``,
        zeros at the start of a sequence); the new state is the last ``K − 1`` projections.
        """
        B, T, C = x.shape
        H, D = self.n_head, self.head_dim
        p = self.c_attn(x)  # [B, T, 3C]
        new_conv_state = None
        if self.conv_size:
            K = self.conv_size
            p = p.transpose(1, 2)  # [B, 3C, T]
            if conv_state is None:
                past = p.new_zeros(B, 3 * C, K - 1)
            else:
                if not isinstance(conv_state, torch.Tensor) or conv_state.shape != (B, 3 * C, K - 1):
                    raise ValueError(f"{type(self).__name__}: conv_state must be [B, 3C, K-1] = "
                                     f"{[B, 3 * C, K - 1]}, got {getattr(conv_state, 'shape', conv_state)}")
                past = conv_state
            full = torch.cat([past, p], dim=2)  # [B, 3C, K − 1 + T]
            new_conv_state = full[:, :, full.shape[2] - (K - 1):]  # the last K − 1 inputs
            p = F.silu(self.qkv_conv(full)).transpose(1, 2)  # [B, T, 3C]
        q, k, v = p.split(C, dim=2)  # 3 × [B, T, C]
        q = q.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        v = v.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        return q, k, v, new_conv_state

    def _merge(self, y: torch.Tensor) -> torch.Tensor:
        """Heads ``[B, H, T, D]`` → ``[B, T, C]``, then the output projection."""
        B, H, T, D = y.shape
        y = y.transpose(1, 2).contiguous().view(B, T, H * D)  # [B, T, C]
        return self.c_proj(y)

    def state_nbytes(self, state) -> int:
        """Bytes held by ``state`` (see :func:`state_nbytes`)."""
        return state_nbytes(state)

    def _conv_numel(self, batch_size: int) -> int:
        """Numbers in the convolution's state: ``B · 3C · (K − 1)``."""
        return batch_size * 3 * self.d_model * max(self.conv_size - 1, 0)

    def extra_repr(self) -> str:
        conv = f", conv_size={self.conv_size}" if self.conv_size else ""
        return f"d_model={self.d_model}, n_head={self.n_head}{conv}"


class SoftmaxAttention(_Mixer):
    """Causal multi-head softmax attention (GPT-2's, chapter 1) with a KV cache (chapter 2).

    ``o = softmax(q kᵀ/√D + mask) v`` through :func:`tinyk3.attention.causal_attention_sdpa`.
    State: ``(k, v)``, each ``[B, H, T_seen, D]``, the keys and values of every token so far.
    New tokens' keys and values are appended (a new tensor; the old state is untouched) and the
    new queries see the whole cache through a bottom-right causal mask.
    Size: ``2·B·H·T·D = 2·B·T·C`` numbers, growing with T (:meth:`state_numel`).
    """

    def _mix(self, q, k, v, x, state):
        if state is not None:
            past_k, past_v = self._check_state(state, q)
            k = torch.cat([past_k, k], dim=2)  # [B, H, T_past + T, D]
            v = torch.cat([past_v, v], dim=2)  # [B, H, T_past + T, D]
        # o = softmax(q kᵀ / √D + mask) v, the new queries being the last T of T_past + T
        y = causal_attention_sdpa(q, k, v)  # [B, H, T, D]
        return y, (k, v)

    def _check_state(self, state, q: torch.Tensor):
        if not (isinstance(state, (tuple, list)) and len(state) == 2):
            raise TypeError("SoftmaxAttention: state must be the pair (k, v) this layer returned")
        k, v = state
        B, H, _, D = q.shape
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"SoftmaxAttention: cached {name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[0] != B or t.shape[1] != H or t.shape[3] != D:
                raise ValueError(
                    f"SoftmaxAttention: cached {name} must be [B={B}, H={H}, T, D={D}], got {tuple(t.shape)}"
                )
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(
                    f"SoftmaxAttention: cached {name} is {t.dtype} on {t.device}, "
                    f"the input {q.dtype} on {q.device}"
                )
        if k.shape[2] != v.shape[2]:
            raise ValueError(
                f"SoftmaxAttention: cached k and v differ in length: {k.shape[2]} vs {v.shape[2]}"
            )
        return k, v

    def state_numel(self, batch_size: int, length: int) -> int:
        """Numbers in the KV cache after ``length`` tokens: K and V, ``2·B·H·T·D``."""
        return 2 * batch_size * self.n_head * length * self.head_dim + self._conv_numel(batch_size)


class LinearAttention(_Mixer):
    """Causal linear attention (Katharopoulos et al., 2020, "Transformers are RNNs"), chapter 3.

    The score ``exp(q·k)`` becomes ``φ(q)·φ(k)`` with a feature map φ applied per head
    (:mod:`tinyk3.ops.feature_maps`; ``"elu+1"`` is the paper's), and the output is

        o_t = φ(q_t) S_t / φ(q_t)·z_t,   S_t = Σ_{j≤t} φ(k_j)ᵀ v_j,   z_t = Σ_{j≤t} φ(k_j)

    (without the denominator if ``normalize=False``). A prompt runs through the parallel form
    :func:`tinyk3.ops.linear_attention.parallel`; one new token (``T == 1``) through one step
    of :func:`tinyk3.ops.linear_attention.recurrent`. State: ``S: [B, H, Dk, Dv]``, or
    ``(S, z)`` with ``z: [B, H, Dk]`` when normalised; ``Dk`` is φ's output size (``D`` for
    the element-wise maps, ``1 + D + D²`` for ``"taylor2"``). Fixed size, whatever the length.
    The ops keep the state in float32 (float64 for float64 inputs).

    With ``"taylor2"`` q and k are first scaled by ``D^{-1/4}``, so that
    ``φ(q)·φ(k) ≈ exp(q·k/√D)``, as in softmax attention (the Based architecture's choice);
    the other maps get q and k as projected.
    """

    def __init__(self, d_model: int, n_head: int, feature_map: str = "elu+1", normalize: bool = True,
                 eps: float = 1e-6, conv_size: int = 0):
        super().__init__(d_model, n_head, conv_size)
        self.phi = feature_maps.get(feature_map)  # ValueError names the choices
        self.feature_map, self.normalize, self.eps = feature_map, bool(normalize), eps
        self.qk_scale = self.head_dim ** -0.25 if feature_map == "taylor2" else 1.0
        self.feature_dim = self.phi(torch.zeros(1, self.head_dim)).shape[-1]  # Dk after φ

    def _mix(self, q, k, v, x, state):
        q = self.phi(q * self.qk_scale)  # φ(q)  [B, H, T, Dk]
        k = self.phi(k * self.qk_scale)  # φ(k)  [B, H, T, Dk]
        op = linear_attention_ops.recurrent if x.shape[1] == 1 else linear_attention_ops.parallel
        # o_t = φ(q_t) S_t / φ(q_t)·z_t,  S_t = S_{t-1} + φ(k_t)ᵀ v_t,  z_t = z_{t-1} + φ(k_t)
        return op(q, k, v, normalize=self.normalize, initial_state=state, eps=self.eps)  # y: [B, H, T, D]

    def state_numel(self, batch_size: int, length: int) -> int:
        """Numbers in the state, for any ``length``: ``B·H·Dk·Dv`` (+ ``B·H·Dk`` for z)."""
        per_head = self.feature_dim * self.head_dim + (self.feature_dim if self.normalize else 0)
        return batch_size * self.n_head * per_head + self._conv_numel(batch_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_map={self.feature_map!r}, normalize={self.normalize}"


class DeltaNet(_Mixer):
    """DeltaNet (Schlag et al., 2021; Yang et al., 2024, "Parallelizing Linear Transformers
    with the Delta Rule over Sequence Length"), chapter 5.

    Per head, q and k are L2-normalised SiLU features, ``F.normalize(F.silu(·))``, the paper's
    choice (fla's ``qk_activation='silu'``, ``qk_norm='l2'``); a write strength
    ``β_t = sigmoid(W_β x_t)`` per head and token (``[B, H, T]``, from ``b_proj``); then
    the delta rule (:mod:`tinyk3.ops.delta_rule`):

        S_t = S_{t-1} + k_tᵀ β_t (v_t − k_t S_{t-1}),   o_t = q_t S_t

    State: ``S: [B, H, D, D]``, fixed size. With ‖k_t‖ = 1 and β_t ∈ (0, 1) the transition
    ``I − β_t k_tᵀ k_t`` has eigenvalues 1 (D − 1 times) and 1 − β_t ∈ (0, 1): it never
    expands the state, so the state cannot blow up the way it does with raw keys (chapter 5).

    ``conv_size`` adds fla's short causal convolution on q, k, v; fla's layer also
    RMS-normalises each head's output (chapter 12).
    ``op`` picks the delta-rule implementation: anything with the contract
    ``op(q, k, v, beta, *, initial_state) -> (o, S)``, such as a chunked form (chapter 8).
    By default a prompt (``T > 1``) runs through :func:`tinyk3.ops.delta_rule.parallel` (one
    triangular solve, ``O(T²)`` memory: fine for the short sequences of Part II) and a single
    token through one step of :func:`tinyk3.ops.delta_rule.recurrent`.
    """

    def __init__(self, d_model: int, n_head: int, op: Callable | None = None, conv_size: int = 0):
        super().__init__(d_model, n_head, conv_size)
        self.b_proj = nn.Linear(d_model, n_head)  # one write strength per head and token
        self.op = op

    def _mix(self, q, k, v, x, state):
        # q, k ← SiLU, then unit length per head: ‖k_t‖ = 1 makes each write a projection
        q = F.normalize(F.silu(q), dim=-1)  # [B, H, T, D]
        k = F.normalize(F.silu(k), dim=-1)  # [B, H, T, D]
        # β_t = sigmoid(W_β x_t) ∈ (0, 1), one per head and token
        beta = torch.sigmoid(self.b_proj(x)).transpose(1, 2)  # [B, T, H] -> [B, H, T]
        # S_t = S_{t-1} + k_tᵀ β_t (v_t − k_t S_{t-1}),  o_t = q_t S_t
        op = self.op or (delta_rule.recurrent if x.shape[1] == 1 else delta_rule.parallel)
        return op(q, k, v, beta, initial_state=state)  # y: [B, H, T, D]

    def state_numel(self, batch_size: int, length: int) -> int:
        """Numbers in the state, for any ``length``: ``B·H·D·D``."""
        return batch_size * self.n_head * self.head_dim * self.head_dim + self._conv_numel(batch_size)


# The mixers a model can be configured with (see tinyk3.models.MixerConfig.mixer).
MIXERS: dict[str, type[_Mixer]] = {
    "softmax": SoftmaxAttention,
    "linear": LinearAttention,
    "deltanet": DeltaNet,
}
