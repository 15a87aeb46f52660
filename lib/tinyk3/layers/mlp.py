"""The feed-forward layers of a block (GPT-2's GELU MLP; chapter 14 adds experts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._validate import positive_int
from .registry import MLPSpec, register_mlp

__all__ = ["MLP", "GeluMLPConfig"]


class MLP(nn.Module):
    """GPT-2's feed-forward: ``c_proj(GELU(c_fc(x)))`` with tanh-approximated GELU
    (``"gelu_new"`` in transformers), hidden width ``ratio · d_model``."""

    def __init__(self, d_model: int, ratio: int = 4):
        super().__init__()
        d_model, ratio = positive_int(d_model, "d_model", "MLP"), positive_int(ratio, "ratio", "MLP")
        hidden = ratio * d_model
        self.c_fc = nn.Linear(d_model, hidden)
        self.c_proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


@register_mlp
@dataclass(frozen=True)
class GeluMLPConfig(MLPSpec):
    """GPT-2's MLP with hidden width ``ratio · d_model`` (GPT-2: 4, its ``n_inner`` default)."""

    ratio: int = 4

    kind: ClassVar[str] = "gelu"
    module: ClassVar[type] = MLP

    def num_parameters(self, d_model: int) -> int:
        """``c_fc`` and ``c_proj`` with biases: ``2rd² + rd + d``."""
        d, r = d_model, self.ratio
        return 2 * r * d * d + r * d + d


@register_mlp
@dataclass(frozen=True)
class NoMLPConfig(MLPSpec):
    """No feed-forward network: a block of the token mixer alone (Mamba-2 and many state-space
    hybrids build their blocks so). The block then has no second norm either."""

    kind: ClassVar[str] = "none"
    module: ClassVar[type] = type(None)

    def build(self, d_model: int) -> None:
        positive_int(d_model, "d_model", "NoMLPConfig")
        return None

    def num_parameters(self, d_model: int) -> int:
        return 0
