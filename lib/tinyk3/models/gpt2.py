"""GPT-2 as an :class:`~tinyk3.models.LM`: its configuration, and its weights from
:class:`tinyk3.gpt2.GPT` (chapter 1's model) or from ``transformers``.

The LM has separate ``q_proj``, ``k_proj``, ``v_proj`` where GPT-2 has one ``c_attn`` of
``[3d, d]`` (q, then k, then v), and ``o_proj`` for GPT-2's ``attn.c_proj``; every other name
is GPT-2's. ``tests/test_models.py`` checks that the logits are equal.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..gpt2 import GPT, GPTConfig
from ..layers import GeluMLPConfig, SoftmaxAttentionConfig
from .config import LMConfig
from .lm import LM

__all__ = ["gpt2_config", "config_from_gpt", "state_dict_from_gpt", "from_gpt", "from_hf_gpt2",
           "from_checkpoint_gpt2"]


def gpt2_config(vocab_size: int = 50257, block_size: int = 1024, n_layer: int = 12,
                n_head: int = 12, n_embd: int = 768, dropout: float = 0.0,
                layer_norm_eps: float = 1e-5) -> LMConfig:
    """The :class:`LMConfig` of a GPT-2; the defaults are GPT-2 small's (see
    :class:`tinyk3.gpt2.GPTConfig` for their source)."""
    return LMConfig(vocab_size=vocab_size, block_size=block_size, n_embd=n_embd,
                    pattern="A" * n_layer, mixers={"A": SoftmaxAttentionConfig(n_head=n_head)},
                    mlp=GeluMLPConfig(ratio=4), pos_emb=True, dropout=dropout,
                    layer_norm_eps=layer_norm_eps)


def config_from_gpt(config: GPTConfig) -> LMConfig:
    """The :class:`LMConfig` of the model a :class:`~tinyk3.gpt2.GPTConfig` describes."""
    return gpt2_config(config.vocab_size, config.block_size, config.n_layer, config.n_head,
                       config.n_embd, config.dropout, config.layer_norm_eps)


def state_dict_from_gpt(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A :class:`tinyk3.gpt2.GPT` state dict with the LM's names: ``attn.c_attn`` split into
    ``attn.q_proj``, ``attn.k_proj``, ``attn.v_proj``, and ``attn.c_proj`` renamed ``attn.o_proj``."""
    out = {}
    for key, val in sd.items():
        if ".attn.c_attn." in key:
            for name, part in zip(("q_proj", "k_proj", "v_proj"), val.chunk(3, dim=0)):
                out[key.replace("c_attn", name)] = part.clone()
        elif ".attn.c_proj." in key:
            out[key.replace("attn.c_proj", "attn.o_proj")] = val
        else:
            out[key] = val
    return out


def from_gpt(gpt: GPT) -> LM:
    """An :class:`LM` with the weights of a :class:`tinyk3.gpt2.GPT`, and the same logits."""
    if not isinstance(gpt, GPT):
        raise TypeError(f"from_gpt: expected a tinyk3.gpt2.GPT, got {type(gpt).__name__}")
    model = LM(config_from_gpt(gpt.config))
    model.load_state_dict(state_dict_from_gpt(gpt.state_dict()))
    return model.to(gpt.transformer.wte.weight.dtype)


def from_hf_gpt2(hf_model) -> LM:
    """An :class:`LM` from a ``transformers`` GPT-2 (``GPT2LMHeadModel`` or ``GPT2Model``),
    through :meth:`tinyk3.gpt2.GPT.from_hf` (which transposes its ``Conv1D`` weights)."""
    return from_gpt(GPT.from_hf(hf_model))


def from_checkpoint_gpt2(config: Mapping, state_dict: Mapping[str, torch.Tensor]) -> LM:
    """An :class:`LM` from GPT-2's ``config.json`` (a dict) and its tensors, as published."""
    gpt_config = GPTConfig(vocab_size=config["vocab_size"], block_size=config["n_positions"],
                           n_layer=config["n_layer"], n_head=config["n_head"],
                           n_embd=config["n_embd"],
                           layer_norm_eps=config.get("layer_norm_epsilon", 1e-5))
    return from_gpt(GPT.from_hf(state_dict, config=gpt_config))
