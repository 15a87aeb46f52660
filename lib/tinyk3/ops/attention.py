"""Causal softmax attention, in the course's layout ``[B, H, T, D]`` (chapters 1 and 2; also
importable as :mod:`tinyk3.attention`).

Three forms with one contract, checked equal in ``tests/test_attention.py``:

* :func:`causal_attention_loop`: the reference, one query at a time (what the maths says);
* :func:`causal_attention`: the masked matrix form, ``softmax(q kᵀ / √D + mask) v``;
* :func:`causal_attention_sdpa`: the same through ``torch.nn.functional.scaled_dot_product_attention``.

All three accept fewer queries than keys (``Tq <= Tk``): the queries are then the *last*
``Tq`` positions of the sequence, which is what happens when new tokens are appended to a KV
cache. Query ``i`` (absolute position ``Tk - Tq + i``) may attend to keys ``0 .. Tk - Tq + i``.

:func:`causal_mask` is the one builder of that mask in the package (MLA, gated attention,
QK-Clip and GPT-2's attention maps use it, through :func:`causal_softmax` where they need the
softmax too); its ``window`` keeps only the last keys, for sliding-window attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "causal_mask",
    "causal_softmax",
    "causal_attention_loop",
    "causal_attention",
    "causal_attention_sdpa",
]


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape [B, H, T, D], got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "shapes do not fit: q [B, H, Tq, D], k [B, H, Tk, D], v [B, H, Tk, Dv]; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k need the same head size, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[2] > k.shape[2]:
        raise ValueError(
            f"more queries ({q.shape[2]}) than keys ({k.shape[2]}): the queries must be the last "
            "positions of the key sequence"
        )


def causal_mask(t_q: int, t_k: int | None = None, device=None, *,
                window: int | None = None) -> torch.Tensor:
    """Boolean ``[t_q, t_k]`` mask, ``True`` where query ``i`` may see key ``j``.

    The queries are the last ``t_q`` of ``t_k`` positions (bottom-right aligned), so
    ``mask[i, j] = j <= (t_k - t_q) + i``. With ``t_q == t_k`` this is the lower triangle.
    ``window``: a query also sees only its last ``window`` keys (itself included), ``j >
    (t_k - t_q) + i - window``.
    """
    t_k = t_q if t_k is None else t_k
    if t_q > t_k:
        raise ValueError(f"t_q={t_q} > t_k={t_k}: queries must be the last positions")
    mask = torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"causal_mask: window must be a positive int, got {window!r}")
        mask = mask.triu(diagonal=t_k - t_q - window + 1)
    return mask


def causal_softmax(scores: torch.Tensor, *, window: int | None = None) -> torch.Tensor:
    """Softmax over the last dimension of ``scores [..., T, S]`` with the bottom-right causal mask
    (query ``i`` is token ``S − T + i`` and sees keys ``0 … S − T + i``), in float32 at least.
    ``window``: each query sees only its last ``window`` keys (:func:`causal_mask`)."""
    T, S = scores.shape[-2:]
    mask = causal_mask(T, S, device=scores.device, window=window)
    dt = scores.dtype if scores.dtype == torch.float64 else torch.float32
    p = scores.to(dt).masked_fill(~mask, float("-inf")).softmax(-1)
    return p.to(scores.dtype)


def causal_attention_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference: for each query, a softmax over the keys it may see. Slow on purpose."""
    _check_qkv(q, k, v)
    t_q, t_k, d = q.shape[2], k.shape[2], q.shape[-1]
    offset = t_k - t_q
    outs = []
    for i in range(t_q):
        keys = k[:, :, : offset + i + 1]  # [B, H, offset+i+1, D]
        vals = v[:, :, : offset + i + 1]  # [B, H, offset+i+1, Dv]
        scores = (q[:, :, i : i + 1] @ keys.transpose(-1, -2)) / math.sqrt(d)  # [B, H, 1, n]
        outs.append(scores.softmax(dim=-1) @ vals)  # [B, H, 1, Dv]
    return torch.cat(outs, dim=2)  # [B, H, Tq, Dv]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Masked matrix form: ``softmax(q kᵀ / √D + mask) v`` with a bottom-right causal mask."""
    _check_qkv(q, k, v)
    t_q, t_k, d = q.shape[2], k.shape[2], q.shape[-1]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)  # [B, H, Tq, Tk]
    allowed = causal_mask(t_q, t_k, device=q.device)  # [Tq, Tk]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1) @ v  # [B, H, Tq, Dv]


def causal_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The fused kernel PyTorch ships; the same maths as :func:`causal_attention`."""
    _check_qkv(q, k, v)
    t_q, t_k = q.shape[2], k.shape[2]
    if t_q == t_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if t_q == 1:  # one new token sees every cached key: no mask at all
        return F.scaled_dot_product_attention(q, k, v)
    # Note: `is_causal=True` aligns the mask top-left when Tq < Tk, which would hide the
    # cached keys from the new queries; an explicit bottom-right mask is required here.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(t_q, t_k, q.device))
