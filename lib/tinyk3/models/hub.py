"""DeepSeek-V3 (and Kimi K2, the same architecture), Qwen3-Next and Kimi Linear as
:class:`LM` s: their
configurations from a ``config.json`` (or a ``transformers`` config), their tensors from a
checkpoint or a ``transformers`` model.

One path serves both loaders: :func:`lm_config_from_hf` reads the configuration, and
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

from ..gates import LOWER_BOUND
from ..layers import (
    GatedAttentionConfig,
    GatedDeltaNetConfig,
    KDAConfig,
    MLAConfig,
    MoEConfig,
    SwiGLUConfig,
)
from ..layers.moe import SITU_CAPS
from ..mxfp4 import dequantize_mxfp4
from .config import LMConfig
from .lm import LM

__all__ = ["lm_config_from_hf", "convert_state_dict", "from_hf_model", "from_checkpoint_hub",
           "from_checkpoint_kimi_k3"]


def _rope(cfg: Mapping) -> tuple[float, dict]:
    """``(theta, rope parameters)`` from a config dict of either ``transformers`` 5 (``rope_parameters``)
    or a hub ``config.json`` (``rope_theta``, ``rope_scaling``); only default RoPE is built."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise NotImplementedError(f"RoPE of type {kind!r} (the released model's long-context "
                                  "scaling) is not built; default RoPE only")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta), params


def _config_dict(config) -> dict:
    return dict(config) if isinstance(config, Mapping) else config.to_dict()


def _common(cfg: Mapping, norm: str, mixers: list, mlps: list) -> LMConfig:
    return LMConfig(vocab_size=cfg["vocab_size"], block_size=cfg.get("max_position_embeddings", 4096),
                    n_embd=cfg["hidden_size"], pattern=tuple(mixers), mlp=tuple(mlps),
                    pos_emb=False, norm=norm, layer_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                    tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def lm_config_from_hf(config) -> LMConfig:
    """The :class:`LMConfig` of a ``deepseek_v3``, ``qwen3_next``, ``kimi_linear`` or ``kimi_k3``
    configuration (a parsed ``config.json`` or a ``transformers`` config object)."""
    cfg = _config_dict(config)
    kind = cfg.get("model_type")
    if kind == "kimi_k3":
        return _kimi_k3(cfg)
    n = cfg["num_hidden_layers"]
    theta, params = _rope(cfg)
    if kind == "deepseek_v3":
        if cfg.get("attention_bias", False):
            raise NotImplementedError("deepseek_v3 with attention_bias=True is not built")
        mla = MLAConfig(n_head=cfg["num_attention_heads"], kv_lora_rank=cfg["kv_lora_rank"],
                        qk_nope_head_dim=cfg["qk_nope_head_dim"],
                        qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                        q_lora_rank=cfg.get("q_lora_rank") or 0, rope_theta=theta,
                        rope_interleave=bool(cfg.get("rope_interleave", True)))
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise NotImplementedError(f"deepseek_v3 with scoring_func {cfg['scoring_func']!r}")
        moe = MoEConfig(cfg["n_routed_experts"], cfg["num_experts_per_tok"],
                        cfg["moe_intermediate_size"], n_shared=cfg.get("n_shared_experts") or 0,
                        n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
        dense = SwiGLUConfig(hidden=cfg["intermediate_size"])
        k = cfg.get("first_k_dense_replace") or 0
        return _common(cfg, "rmsnorm", [mla] * n, [dense if i < k else moe for i in range(n)])
    if kind == "qwen3_next":
        if cfg.get("attention_bias", False):
            raise NotImplementedError("qwen3_next with attention_bias=True is not built")
        eps = cfg.get("rms_norm_eps", 1e-6)
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        attn = GatedAttentionConfig(n_head=cfg["num_attention_heads"],
                                    n_kv_head=cfg["num_key_value_heads"], head_dim=head_dim,
                                    partial_rotary_factor=partial, rope_theta=theta, norm_eps=eps)
        gdn = GatedDeltaNetConfig(n_head=cfg["linear_num_key_heads"],
                                  head_dim=cfg["linear_key_head_dim"],
                                  n_v_head=cfg["linear_num_value_heads"],
                                  v_head_dim=cfg["linear_value_head_dim"],
                                  conv_size=cfg["linear_conv_kernel_dim"], norm_eps=eps)
        types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0
            else "linear_attention" for i in range(n)]
        mixers = [attn if t == "full_attention" else gdn for t in types]
        moe = MoEConfig(cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                        shared_hidden=cfg.get("shared_expert_intermediate_size") or 0,
                        scoring="softmax", norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                        shared_gate=True)
        dense = SwiGLUConfig(hidden=cfg["intermediate_size"])
        only = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step", 1)
        mlps = [moe if i not in only and cfg["num_experts"] > 0 and (i + 1) % step == 0 else dense
                for i in range(n)]
        return _common(cfg, "rmsnorm_centred", mixers, mlps)
    if kind == "kimi_linear":
        return _kimi_linear(cfg)
    raise NotImplementedError(f"lm_config_from_hf: model_type {kind!r}")


def _get(cfg: Mapping, *names, default=None):
    """The first of ``names`` present in ``cfg`` (``transformers``' name, then the hub's)."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _kimi_k3(config: Mapping) -> LMConfig:
    """Kimi K3 from its published ``config.json`` (the text model: ``text_config`` if present).

    Read as mlx-lm 0.32.2's ``models/kimi_k3.py`` reads it: KDA where ``(i + 1)`` is in
    ``linear_attn_config["kda_layers"]`` (1-based), NoPE MLA elsewhere; MoE where ``i >=
    first_k_dense_replace`` and ``i % moe_layer_freq == 0``; experts in the
    ``routed_expert_hidden_size`` latent; SiTU-GLU everywhere; attention residuals every
    ``attn_res_block_size`` layers."""
    cfg = dict(config.get("text_config") or config)
    n, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    lin = cfg["linear_attn_config"]
    if cfg.get("hidden_act", "situ") != "situ" or (
            (cfg.get("activation_situ_beta") or 1.0, cfg.get("activation_situ_linear_beta"))
            != SITU_CAPS):
        raise NotImplementedError("kimi_k3: only SiTU-GLU with caps (4, 25) is built, got "
                                  f"{cfg.get('hidden_act')!r}, {cfg.get('activation_situ_beta')!r}, "
                                  f"{cfg.get('activation_situ_linear_beta')!r}")
    if not cfg.get("mla_use_nope", True):
        raise NotImplementedError("kimi_k3: MLA with RoPE (mla_use_nope=False) is not built")
    bound = lin.get("gate_lower_bound")
    if bound is not None and float(bound) != LOWER_BOUND:
        raise NotImplementedError(f"kimi_k3: gate_lower_bound {bound} (only {LOWER_BOUND} is built)")
    if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise NotImplementedError("kimi_k3: only the sigmoid router is built")
    eps = cfg.get("rms_norm_eps", 1e-5)
    kda = KDAConfig(n_head=lin["num_heads"], head_dim=lin["head_dim"],
                    conv_size=lin.get("short_conv_kernel_size", 4),
                    gate="softplus" if bound is None else "lower_bound",
                    output_gate="full" if lin.get("use_full_rank_gate") else "low_rank",
                    norm_eps=eps)
    mla = MLAConfig(n_head=cfg["num_attention_heads"], kv_lora_rank=cfg["kv_lora_rank"],
                    qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    q_lora_rank=cfg.get("q_lora_rank") or 0, use_rope=False,
                    output_gate=bool(cfg.get("mla_use_output_gate", False)))
    kda_layers = set(lin["kda_layers"])
    mixers = [kda if i + 1 in kda_layers else mla for i in range(n)]
    n_experts = cfg.get("num_experts") or 0
    moe = None
    if n_experts:
        moe = MoEConfig(n_experts, cfg.get("num_experts_per_token", 16), cfg["moe_intermediate_size"],
                        n_shared=cfg.get("num_shared_experts") or 0,
                        n_group=cfg.get("num_expert_group") or 1, topk_group=cfg.get("topk_group") or 1,
                        norm_topk_prob=bool(cfg.get("moe_renormalize", True)),
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                        activation="situ", latent_dim=cfg.get("routed_expert_hidden_size") or 0,
                        latent_norm=bool(cfg.get("latent_moe_use_norm", False)), norm_eps=eps)
    dense = SwiGLUConfig(hidden=cfg["intermediate_size"], activation="situ")
    k, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
    mlps = [moe if moe is not None and i >= k and i % freq == 0 else dense for i in range(n)]
    return LMConfig(vocab_size=cfg["vocab_size"], block_size=cfg.get("max_position_embeddings", 1048576),
                    n_embd=d, pattern=tuple(mixers), mlp=tuple(mlps), pos_emb=False, norm="rmsnorm",
                    layer_norm_eps=eps, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                    attn_res_block_size=cfg.get("attn_res_block_size") or 0)


def _kimi_linear(cfg: Mapping) -> LMConfig:
    """Kimi Linear: KDA and NoPE MLA by ``layer_types`` (or the hub config's 1-based
    ``linear_attn_config["full_attn_layers"]``), dense or sparse feed-forwards."""
    n = cfg["num_hidden_layers"]
    lin = cfg.get("linear_attn_config") or {}
    types = cfg.get("layer_types")
    if types is None:
        full = set(lin.get("full_attn_layers", ()))  # 1-based in the released config
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    eps = cfg.get("rms_norm_eps", 1e-5)
    head_dim = _get(cfg, "linear_head_dim", default=lin.get("head_dim", 128))
    kda = KDAConfig(n_head=_get(cfg, "linear_num_heads", default=lin.get("num_heads", 32)),
                    head_dim=head_dim,
                    conv_size=_get(cfg, "linear_conv_kernel_dim",
                                   default=lin.get("short_conv_kernel_size", 4)),
                    norm_eps=eps)
    mla = MLAConfig(n_head=cfg["num_attention_heads"], kv_lora_rank=cfg["kv_lora_rank"],
                    qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    q_lora_rank=cfg.get("q_lora_rank") or 0, use_rope=False)
    moe = MoEConfig(_get(cfg, "num_local_experts", "num_experts"),
                    _get(cfg, "num_experts_per_tok", "num_experts_per_token"),
                    cfg["moe_intermediate_size"],
                    n_shared=_get(cfg, "n_shared_experts", "num_shared_experts", default=0),
                    n_group=_get(cfg, "n_group", "num_expert_group", default=1),
                    topk_group=_get(cfg, "topk_group", default=1),
                    norm_topk_prob=bool(_get(cfg, "norm_topk_prob", "moe_renormalize", default=True)),
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
    mlp_types = cfg.get("mlp_layer_types") or [
        "dense" if i < cfg.get("first_k_dense_replace", 1) else "sparse" for i in range(n)]
    dense = SwiGLUConfig(hidden=cfg["intermediate_size"])
    return _common(cfg, "rmsnorm", [mla if t == "full_attention" else kda for t in types],
                   [moe if t == "sparse" else dense for t in mlp_types])


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
