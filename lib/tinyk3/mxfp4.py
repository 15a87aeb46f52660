"""MXFP4, the format of Kimi K3's released routed experts (chapter 17).

OCP Microscaling (MX) FP4: weights in groups of 32 consecutive values along a row (the input
dimension of a ``[out, in]`` weight), each value a 4-bit E2M1 float (1 sign bit, 2 exponent
bits, 1 mantissa bit) and each group one shared 8-bit E8M0 scale (a power of two). The
released checkpoint stores them as ``compressed-tensors``' ``mxfp4-pack-quantized``:

* ``weight_packed``: ``uint8 [out, in/2]``, two E2M1 codes per byte, the **low nibble first**
  (value ``2j`` in bits 0-3 of byte ``j``, value ``2j + 1`` in bits 4-7);
* ``weight_scale``: ``uint8 [out, in/32]``, the group's scale ``2^(s − 127)``.

An E2M1 code ``c`` (0-15) is ``(−1)^(c >> 3) · E2M1_MAGNITUDES[c & 7]``; the eight magnitudes
are ``0, 0.5, 1, 1.5, 2, 3, 4, 6``. A weight is ``value(code) · 2^(s − 127)``.

:func:`dequantize_mxfp4` reads the format (what ``from_checkpoint`` does with K3's experts);
:func:`quantize_mxfp4` writes it (round to the nearest E2M1 value after dividing by the
OCP scale ``2^(floor(log2 max|w|) − 2)``), for building packed test checkpoints and measuring
the format's error. mlx's ``mx.quantize(..., mode="mxfp4")`` and torchtitan's
``models/kimi_k3/packed_mxfp4.py`` implement the same format; ``tests/test_mxfp4.py`` checks
both directions against mlx.
"""

from __future__ import annotations

import torch

from ._validate import positive_int

__all__ = ["E2M1_MAGNITUDES", "GROUP_SIZE", "SCALE_BIAS", "SCALE_RULES", "e2m1_value",
           "e8m0_scale", "dequantize_mxfp4", "quantize_mxfp4"]

#: The eight magnitudes of an E2M1 code's low three bits (bit 3 is the sign).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
GROUP_SIZE = 32  # values per shared scale
SCALE_BIAS = 127  # E8M0: scale = 2^(s − 127)
_NAN_SCALE = 255  # E8M0's one non-number (OCP MX v1.0)


def _table(dtype, device) -> torch.Tensor:
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])  # codes 0-7 positive, 8-15 negative


def e2m1_value(code: int) -> float:
    """The number an E2M1 code (0-15) stands for: sign bit 3, magnitude from bits 0-2."""
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 15:
        raise ValueError(f"e2m1_value: a code is an int in 0 … 15, got {code!r}")
    sign = -1.0 if code & 8 else 1.0
    return sign * E2M1_MAGNITUDES[code & 7]


def e8m0_scale(s: int) -> float:
    """The power of two an E8M0 byte stands for, ``2^(s − 127)``; 255 is not a number."""
    if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= 254:
        raise ValueError(f"e8m0_scale: a scale byte is an int in 0 … 254 (255 is NaN), got {s!r}")
    return 2.0 ** (s - SCALE_BIAS)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, *, group_size: int = GROUP_SIZE,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., n]`` weights from ``packed`` (``uint8 [..., n/2]``, low nibble first) and
    ``scale`` (``uint8 [..., n/group_size]``, E8M0), in ``dtype`` (float32 by default: every
    MXFP4 value is exact in it; bfloat16 too, float16 overflows above 2^15·6).

    Raises ``ValueError`` for other dtypes, shapes that do not match, and scale bytes of 255
    (NaN in the OCP MX format), naming what was found."""
    if not isinstance(packed, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise TypeError("dequantize_mxfp4: packed and scale must be tensors")
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"dequantize_mxfp4: packed and scale must be uint8, got {packed.dtype} "
                         f"and {scale.dtype}")
    group_size = positive_int(group_size, "group_size", "dequantize_mxfp4")
    if group_size % 2:
        raise ValueError(f"dequantize_mxfp4: group_size must be even, got {group_size}")
    if packed.dim() < 1 or scale.dim() != packed.dim() or packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"dequantize_mxfp4: packed {tuple(packed.shape)} and scale "
                         f"{tuple(scale.shape)} must agree on every dimension but the last")
    n = 2 * packed.shape[-1]
    if n % group_size or scale.shape[-1] != n // group_size:
        raise ValueError(f"dequantize_mxfp4: {n} values per row need {n / group_size:g} scales "
                         f"of {group_size}, got {scale.shape[-1]}")
    if bool((scale == _NAN_SCALE).any()):
        raise ValueError("dequantize_mxfp4: a scale byte is 255, which E8M0 reserves for NaN")
    low, high = packed & 0x0F, packed >> 4
    codes = torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], n).long()
    values = _table(torch.float32, packed.device)[codes]
    powers = torch.exp2(scale.to(torch.float32) - SCALE_BIAS)  # exact powers of two
    w = values.reshape(*scale.shape, group_size) * powers.unsqueeze(-1)
    return w.reshape(*packed.shape[:-1], n).to(dtype)


SCALE_RULES = ("ocp", "no_clip")


def quantize_mxfp4(weight: torch.Tensor, *, group_size: int = GROUP_SIZE, scale_rule: str = "ocp"):
    """``(packed, scale)`` in the released format for a float ``weight [..., n]``
    (``n`` a multiple of ``group_size``).

    Each group's scale ``2^e`` is chosen by ``scale_rule``:

    * ``"ocp"`` (the OCP MX specification's, torchtitan's): ``e = floor(log2 max|w|) − 2``
      (the largest E2M1 magnitude, 6, is ``1.5·2²``), so the group's largest value lands in
      ``[4, 8)`` and anything above 6 is clipped to 6;
    * ``"no_clip"`` (mlx's ``mx.quantize``): ``e = ceil(log2(max|w| / 6))``, the smallest power
      of two that puts every value within ±6: nothing is clipped, but the grid can be up to
      twice as coarse.

    An all-zero group gets ``2^−127``. Each value is divided by the scale and rounded to the
    nearest of the 16 E2M1 values (ties to the smaller code). Round-to-nearest is what a
    post-training conversion does; quantisation-aware training instead trains weights that
    sit on the grid."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() < 1:
        raise ValueError(f"quantize_mxfp4: weight must be a float tensor [..., n], got "
                         f"{getattr(weight, 'dtype', type(weight).__name__)}")
    group_size = positive_int(group_size, "group_size", "quantize_mxfp4")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"quantize_mxfp4: scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    n = weight.shape[-1]
    if n % group_size or group_size % 2:
        raise ValueError(f"quantize_mxfp4: the last dimension ({n}) must be a multiple of the "
                         f"group size ({group_size}, even)")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("quantize_mxfp4: weight holds inf or NaN")
    lead = weight.shape[:-1]
    groups = weight.detach().to(torch.float64).reshape(*lead, n // group_size, group_size)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    log2 = torch.log2(amax.clamp_min(1e-300))
    e = torch.floor(log2) - 2 if scale_rule == "ocp" else torch.ceil(log2 - torch.log2(torch.tensor(6.0)))
    exponent = torch.where(amax > 0, e, torch.full_like(amax, -SCALE_BIAS))
    s = (exponent + SCALE_BIAS).clamp(0, 254)
    x = groups / torch.exp2(s - SCALE_BIAS)
    table = _table(torch.float64, weight.device)
    codes = (x.unsqueeze(-1) - table).abs().argmin(dim=-1)  # nearest; first (smaller code) on ties
    codes = codes.reshape(*lead, n).to(torch.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    return packed, s.squeeze(-1).to(torch.uint8).contiguous()
