"""Models from ``transformers`` and from published checkpoints, by ``model_type``."""

from __future__ import annotations

from collections.abc import Mapping

from .gpt2 import from_checkpoint_gpt2, from_hf_gpt2
from .hub import from_checkpoint_hub, from_checkpoint_kimi_k3, from_hf_model

__all__ = ["from_hf", "from_checkpoint"]

# model_type -> loader (Kimi K3 has no transformers model: from_checkpoint only)
HF_LOADERS = {"gpt2": from_hf_gpt2, "deepseek_v3": from_hf_model, "qwen3_next": from_hf_model,
              "kimi_linear": from_hf_model}
CHECKPOINT_LOADERS = {"gpt2": from_checkpoint_gpt2, "deepseek_v3": from_checkpoint_hub,
                      "qwen3_next": from_checkpoint_hub, "kimi_linear": from_checkpoint_hub,
                      "kimi_k3": from_checkpoint_kimi_k3}


def from_hf(model):
    """A ``tinyk3`` model with the weights and the logits of a ``transformers`` model."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in HF_LOADERS:
        raise NotImplementedError(f"from_hf: model_type {model_type!r} is not supported; "
                                  f"supported: {sorted(HF_LOADERS)}")
    return HF_LOADERS[model_type](model)


def from_checkpoint(config: Mapping, state_dict: Mapping):
    """A ``tinyk3`` model from a checkpoint's parsed ``config.json`` and its tensors."""
    if not isinstance(config, Mapping):
        raise TypeError(f"from_checkpoint: config is the parsed config.json (a dict), "
                        f"got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type not in CHECKPOINT_LOADERS:
        raise NotImplementedError(f"from_checkpoint: model_type {model_type!r} is not "
                                  f"supported; supported: {sorted(CHECKPOINT_LOADERS)}")
    return CHECKPOINT_LOADERS[model_type](config, state_dict)
