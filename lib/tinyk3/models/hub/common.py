"""What the per-model readers share: the RoPE parameters, a config as a dict, the fields every
:class:`~tinyk3.models.LMConfig` of a hub model takes from its ``config.json``, and a lookup
of a field that ``transformers`` and the hub name differently."""

from __future__ import annotations

from collections.abc import Mapping

from ..config import LMConfig

__all__ = ["rope_parameters", "config_dict", "common", "first_of"]


def rope_parameters(cfg: Mapping) -> tuple[float, dict]:
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


def config_dict(config) -> dict:
    return dict(config) if isinstance(config, Mapping) else config.to_dict()


def common(cfg: Mapping, norm: str, mixers: list, mlps: list) -> LMConfig:
    return LMConfig(vocab_size=cfg["vocab_size"], block_size=cfg.get("max_position_embeddings", 4096),
                    n_embd=cfg["hidden_size"], pattern=tuple(mixers), mlp=tuple(mlps),
                    pos_emb=False, norm=norm, layer_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                    tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def first_of(cfg: Mapping, *names, default=None):
    """The first of ``names`` present in ``cfg`` (``transformers``' name, then the hub's)."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


