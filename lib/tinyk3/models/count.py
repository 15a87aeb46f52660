"""Parameter counts by formula, for any configuration a model's ``.config`` holds."""

from __future__ import annotations

from typing import NamedTuple

from ..gpt2 import GPTConfig
from .config import LMConfig
from .gpt2 import config_from_gpt

__all__ = ["ParameterCount", "count_parameters"]


class ParameterCount(NamedTuple):
    """``total``: every parameter, a tied head counted once; ``active``: those one token uses
    (``total`` less the routed experts it is not sent to; equal without experts)."""

    total: int
    active: int


def count_parameters(config) -> ParameterCount:
    """Parameters of the model built from ``config``, by formula: ``(total, active)``.

    ``total`` equals ``sum(p.numel() for p in model.parameters())`` exactly
    (``tests/test_models.py`` checks it at several configurations). ``active`` leaves out the
    routed experts a token is not sent to (:meth:`MoEConfig.num_active_parameters`).

    Per block: two LayerNorms ``4d`` (RMSNorms ``2d``), the mixer (its configuration's
    ``num_parameters``: q, k, v and output projections ``4d² + 4d``, DeltaNet's ``W_β``
    ``d·H + H``, a short convolution ``3d·K + 3d``) and the MLP (GPT-2's ``2rd² + rd + d``, or
    any MLP kind's ``num_parameters``). Plus the token embedding ``V·d`` (the head reuses it,
    or adds its own ``V·d`` untied), positions ``P·d`` if learned, and the final norm. With
    softmax attention and ``r = 4`` a block is GPT-2's ``12d² + 13d``. Attention residuals add
    ``2d`` per depth mix: two per block and one before the head. A
    :class:`tinyk3.gpt2.GPTConfig` is accepted too.
    """
    if isinstance(config, GPTConfig):
        config = config_from_gpt(config)
    if not isinstance(config, LMConfig):
        raise TypeError(f"count_parameters: expected an LMConfig or a GPTConfig, "
                        f"got {type(config).__name__}")
    d = config.n_embd
    norm = 2 * d if config.norm == "layernorm" else d  # LayerNorm has a bias, RMSNorm none
    total = config.vocab_size * d * (1 if config.tie_embeddings else 2) + norm
    total += config.block_size * d if config.pos_emb else 0
    res = 2 * d if config.attn_res_block_size else 0  # one depth mix: a d → 1 map and a norm
    total += res  # the final mix before the head
    active = total
    for mixer, mlp in zip(config.layer_mixers, config.layer_mlps):
        parts = 1 if mlp.kind == "none" else 2  # a mixer-only block has one norm and one read
        block = parts * (norm + res) + mixer.num_parameters(d)
        total += block + mlp.num_parameters(d)
        active += block + mlp.num_active_parameters(d)
    return ParameterCount(total, active)
