"""DeepSeek-V3 (and Kimi K2, the same architecture), Qwen3-Next and Kimi Linear as
:class:`LM` s: their
configurations from a ``config.json`` (or a ``transformers`` config), their tensors from a
checkpoint or a ``transformers`` model.

One path serves both loaders: :func:`lm_config_from_hf` reads the configuration (one module
per ``model_type``: ``deepseek_v3``, ``qwen3_next``, ``kimi_linear``, ``kimi_k3``), and
:func:`convert_state_dict` renames the tensors (``model.layers.N.self_attn.*`` →
``transformer.h.N.attn.*``, the router ``mlp.gate`` → ``mlp.router``, norms → ``ln_1``, ``ln_2``,
``ln_f``). It takes ``transformers``' runtime names (the routed experts stacked,
``experts.gate_up_proj [E, 2h, d]``) or the published checkpoints' (one
``experts.N.gate_proj / up_proj / down_proj`` per expert, stacked here), with or without a
``model.`` or ``language_model.`` prefix. Kimi K3's released routed experts are MXFP4
(``experts.N.w1.weight_packed`` and ``.weight_scale``, :mod:`tinyk3.mxfp4`): they are
dequantised here, into the dtype of the checkpoint's other float tensors. DeepSeek-V3's
multi-token-prediction layer (layer index ``num_hidden_layers`` in its checkpoint) is not
built, as in ``transformers``, and its tensors are dropped. YaRN-scaled RoPE (the released
DeepSeek-V3 and Kimi K2 configs) is not built: loading such a config raises
``NotImplementedError`` (the presets, which only count and size, do not need it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ...layers import MoEConfig
from ...mxfp4 import dequantize_mxfp4
from ..config import LMConfig
from ..lm import LM
from . import deepseek_v3, kimi_k3, kimi_linear, qwen3_next
from .common import config_dict

__all__ = ["lm_config_from_hf", "convert_state_dict", "from_hf_model", "from_checkpoint_hub",
           "from_checkpoint_kimi_k3"]


# model_type -> the reader of its configuration (one module each)
CONFIG_READERS = {"deepseek_v3": deepseek_v3.config_from_hf, "qwen3_next": qwen3_next.config_from_hf,
                  "kimi_linear": kimi_linear.config_from_hf, "kimi_k3": kimi_k3.config_from_hf}


def lm_config_from_hf(config) -> LMConfig:
    """The :class:`LMConfig` of a ``deepseek_v3``, ``qwen3_next``, ``kimi_linear`` or ``kimi_k3``
    configuration (a parsed ``config.json`` or a ``transformers`` config object)."""
    cfg = config_dict(config)
    kind = cfg.get("model_type")
    if kind not in CONFIG_READERS:
        raise NotImplementedError(f"lm_config_from_hf: model_type {kind!r}")
    return CONFIG_READERS[kind](cfg)


_BLOCK_NAMES = {"input_layernorm.": "ln_1.", "post_attention_layernorm.": "ln_2.",
                "self_attn.": "attn.", "linear_attn.": "attn.",
                "mlp.gate.": "mlp.router.", "mlp.shared_expert.": "mlp.shared_experts.",
                "mlp.shared_expert_gate.": "mlp.shared_gate.",
                # Kimi K3's checkpoint: the MoE is "block_sparse_moe", its bias may sit beside the gate
                "block_sparse_moe.gate.": "mlp.router.",
                "block_sparse_moe.e_score_correction_bias": "mlp.router.e_score_correction_bias",
                "block_sparse_moe.": "mlp."}
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.(weight|weight_packed|weight_scale)$")
_EXPERT_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's names
# attention residuals: the checkpoint's "X.proj_weight" and mlx-lm's "X_proj.weight" → "X.proj.weight"
_RES = re.compile(r"^(self_attention_res|mlp_res|output_attn_res)(?:\.|_)(proj|norm)(?:_|\.)weight$")


def convert_state_dict(config: LMConfig, state_dict: Mapping[str, torch.Tensor]) -> dict:
    """A checkpoint's or a ``transformers`` model's tensors under :class:`LM`'s names (see the
    module docstring); keys of layers past ``config.n_layer`` (multi-token prediction) and
    rotary buffers are dropped."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    packed: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}  # MXFP4 experts
    mixer_parts: dict[int, dict[str, torch.Tensor]] = {}
    float_dtype = next((t.dtype for t in state_dict.values() if t.is_floating_point()),
                       torch.float32)
    for key, t in state_dict.items():
        key = key.removeprefix("language_model.").removeprefix("model.")
        if key.endswith("inv_freq"):
            continue
        m = _RES.match(key)
        if m:  # the final depth mix, before the head
            out[f"transformer.{m.group(1)}.{m.group(2)}.weight"] = t
        elif key == "embed_tokens.weight":
            out["transformer.wte.weight"] = t
        elif key == "norm.weight":
            out["transformer.ln_f.weight"] = t
        elif key == "lm_head.weight":
            out["lm_head.weight"] = t
        elif key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            i = int(i)
            if i >= config.n_layer:
                continue  # the multi-token-prediction layer: not built
            m = _EXPERT.match(rest)
            if m:
                part = _EXPERT_PART.get(m.group(2), m.group(2))
                if m.group(3) == "weight":
                    experts.setdefault((i, part), {})[int(m.group(1))] = t
                else:
                    packed.setdefault((i, part, int(m.group(1))), {})[m.group(3)] = t
                continue
            m = _RES.match(rest)
            if m:
                out[f"transformer.h.{i}.{m.group(1)}.{m.group(2)}.weight"] = t
                continue
            if rest.startswith(("self_attn.", "linear_attn.")):
                mixer_parts.setdefault(i, {})[rest.split(".", 1)[1]] = t
                continue
            for old, new in _BLOCK_NAMES.items():
                if rest.startswith(old):
                    rest = new + rest[len(old):]
                    break
            out[f"transformer.h.{i}.{rest}"] = t
    for (i, part, e), pair in packed.items():
        if set(pair) != {"weight_packed", "weight_scale"}:
            raise ValueError(f"convert_state_dict: layer {i}, expert {e}, {part}: MXFP4 needs "
                             f"both weight_packed and weight_scale, got only {sorted(pair)}")
        try:
            w = dequantize_mxfp4(pair["weight_packed"], pair["weight_scale"], dtype=float_dtype)
        except ValueError as err:
            raise ValueError(f"convert_state_dict: layer {i}, expert {e}, {part}: {err}") from None
        experts.setdefault((i, part), {})[e] = w
    for i, parts in mixer_parts.items():
        convert = getattr(config.layer_mixers[i].module, "convert_hf_state_dict", None)
        for name, t in (convert(parts) if convert else parts).items():
            out[f"transformer.h.{i}.attn.{name}"] = t
    for i in sorted({i for i, _ in experts}):
        gate, up, down = (experts.get((i, p), {}) for p in ("gate_proj", "up_proj", "down_proj"))
        E = len(gate)
        if not (E == len(up) == len(down)) or sorted(gate) != list(range(E)):
            raise ValueError(f"convert_state_dict: layer {i}'s experts are incomplete")
        out[f"transformer.h.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([gate[e], up[e]], dim=0) for e in range(E)])
        out[f"transformer.h.{i}.mlp.experts.down_proj"] = torch.stack([down[e] for e in range(E)])
    for i, spec in enumerate(config.layer_mlps):  # a softmax router has no score bias: zeros
        key = f"transformer.h.{i}.mlp.router.e_score_correction_bias"
        if isinstance(spec, MoEConfig) and key not in out:
            out[key] = torch.zeros(spec.n_experts)
    return out


def _load(config: LMConfig, state_dict: Mapping[str, torch.Tensor]) -> LM:
    sd = convert_state_dict(config, state_dict)
    ref = next((t for t in sd.values() if t.is_floating_point()), next(iter(sd.values())))
    with torch.device("meta"):
        model = LM(config)
    model = model.to_empty(device=ref.device).to(ref.dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if config.tie_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"from_checkpoint: tensors missing {missing[:8]} or unexpected "
                         f"{unexpected[:8]} for this configuration")
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    return model.eval()


def from_checkpoint_hub(config: Mapping, state_dict: Mapping[str, torch.Tensor]) -> LM:
    """An :class:`LM` from a DeepSeek-V3 / Kimi K2, Qwen3-Next or Kimi Linear ``config.json``
    and its tensors (the config's ``model_type`` decides)."""
    return _load(lm_config_from_hf(config), state_dict)


def from_hf_model(model) -> LM:
    """An :class:`LM` with the weights and logits of ``transformers``' ``DeepseekV3ForCausalLM``,
    ``Qwen3NextForCausalLM`` or ``KimiLinearForCausalLM`` (its config's ``model_type`` decides)."""
    return _load(lm_config_from_hf(model.config), model.state_dict())


def from_checkpoint_kimi_k3(config: Mapping, state_dict: Mapping[str, torch.Tensor]) -> LM:
    """An :class:`LM` from Kimi K3's published ``config.json`` (with its ``text_config``) and
    tensors under the checkpoint's names, with or without ``language_model.``; the vision
    tower's tensors and the multi-token-prediction layers are ignored (the course builds the
    text model)."""
    vision = ("vision_tower", "vision_model", "multi_modal_projector", "mm_projector")
    text = {k: v for k, v in state_dict.items()
            if not k.removeprefix("language_model.").startswith(vision + ("model.mtp", "mtp"))}
    return _load(lm_config_from_hf(config), text)
