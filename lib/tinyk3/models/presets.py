"""Configurations of released models (chapters 10-17 add DeepSeek-V3, Kimi K2, Kimi Linear
and Kimi K3 here)."""

from __future__ import annotations

from .config import LMConfig
from .gpt2 import gpt2_config

__all__ = ["gpt2_small"]


def gpt2_small() -> LMConfig:
    """GPT-2 small (124M): 12 layers of softmax attention, 12 heads, width 768, 1,024
    positions, a vocabulary of 50,257, a tied head.

    Source: OpenAI's released ``hparams.json`` for the 124M model (``n_vocab`` 50,257,
    ``n_ctx`` 1,024, ``n_embd`` 768, ``n_head`` 12, ``n_layer`` 12), which are also the
    defaults of ``transformers.GPT2Config``. ``count_parameters(gpt2_small()).total`` is
    124,439,808, which ``tests/test_models.py`` sets against the built model and
    ``tests/test_gpt2.py`` against transformers' GPT-2.
    """
    return gpt2_config()
