"""Attention residuals (Kimi Team, *Attention Residuals*, arXiv 2603.15031; Kimi K3, chapter 17):
the residual stream read through a softmax over depth. :class:`DepthMix` is one read; the
block structure (which layer starts a block, the final read before the head) is
:class:`tinyk3.models.lm.Block`'s and :class:`tinyk3.models.LM`'s."""

from __future__ import annotations

import torch
import torch.nn as nn

from .parts import RMSNorm

__all__ = ["DepthMix"]


class DepthMix(nn.Module):
    """One attention-residual read (Kimi Team, *Attention Residuals*, arXiv 2603.15031; Kimi K3):
    a softmax over depth of the completed block sums and the current partial sum.

    Each source ``s`` (a ``[B, T, d]`` tensor) gets the logit ``(s / rms(s)) · (w_norm ⊙ w_proj)``,
    its RMS-normed self against one learned vector (no ``1/√d``); the read is ``Σ p_s s`` over
    the raw sources, computed in float32. Parameters as the released checkpoint names them after
    mlx-lm's renaming: ``{name}_proj`` (a ``d → 1`` linear map) and ``{name}_norm`` (its RMSNorm's
    weight; only the weight is used). With no completed block yet it returns the partial sum.
    """

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.proj = nn.Linear(d, 1, bias=False)
        self.norm = RMSNorm(d, eps)
        nn.init.zeros_(self.proj.weight)  # a uniform mix until trained (LM keeps it so)

    def forward(self, blocks: list, partial: torch.Tensor) -> torch.Tensor:
        if not blocks:
            return partial
        dt = torch.float64 if partial.dtype == torch.float64 else torch.float32
        w = self.norm.weight.to(dt) * self.proj.weight.to(dt).reshape(-1)  # [d]
        src = torch.stack([*blocks, partial]).to(dt)  # [S, B, T, d]
        inv_rms = torch.rsqrt(src.pow(2).mean(-1) + self.norm.eps)  # [S, B, T]
        p = torch.softmax((src @ w) * inv_rms, dim=0)  # over depth
        return (p.unsqueeze(-1) * src).sum(0).to(partial.dtype)
