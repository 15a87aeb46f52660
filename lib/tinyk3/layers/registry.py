"""The registries of layer kinds: how a model configuration names its mixers and MLPs.

A mixer kind is a frozen dataclass derived from :class:`MixerSpec` (its hyper-parameters,
named as the module's constructor arguments) with two class attributes, ``kind`` (the name a
configuration uses) and ``module`` (the ``nn.Module`` it builds, ``module(d_model, **fields)``),
registered with :func:`register_mixer`. Chapters 10-17 add kinds (gated delta rule, KDA, MLA)
this way, and MLP kinds (a mixture of experts) with :func:`register_mlp`: new modules, not
new branches in the model.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .._validate import nonnegative_int, positive_int

__all__ = ["MixerSpec", "MLPSpec", "MIXERS", "MIXER_CONFIGS", "MLPS", "MLP_CONFIGS",
           "register_mixer", "register_mlp", "mixer_config"]

MIXERS: dict[str, type] = {}  # kind -> module class, e.g. "deltanet" -> DeltaNet
MIXER_CONFIGS: dict[str, type] = {}  # kind -> config class, e.g. "deltanet" -> DeltaNetConfig
MLPS: dict[str, type] = {}
MLP_CONFIGS: dict[str, type] = {}


def _check_ints(spec) -> None:
    """Every ``int`` field: ``n_*`` and ``*_size`` fields >= 0 or >= 1 as their default says."""
    name = type(spec).__name__
    for f in dataclasses.fields(spec):
        if f.type not in ("int", int):
            continue
        value = getattr(spec, f.name)
        if f.name == "conv_size" or f.default == 0:
            nonnegative_int(value, f.name, name)
        else:
            positive_int(value, f.name, name)


class MixerSpec:
    """Base of the mixer configurations (frozen dataclasses); see the module docstring."""

    kind: ClassVar[str] = ""
    module: ClassVar[type] = object

    def __post_init__(self) -> None:
        _check_ints(self)

    def check(self, d_model: int) -> None:
        """``ValueError`` unless ``d_model`` splits into this mixer's ``n_head`` heads (a kind
        without ``n_head`` overrides it)."""
        if d_model % self.n_head:
            raise ValueError(f"{type(self).__name__}: d_model ({d_model}) must be divisible "
                             f"by n_head ({self.n_head})")

    def build(self, d_model: int):
        """The layer: ``module(d_model, **fields)``."""
        self.check(d_model)
        return self.module(d_model, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def num_parameters(self, d_model: int) -> int:
        """Parameters by formula: q, k, v and output projections ``4d² + 4d``; a short
        convolution of ``K = conv_size`` taps on q, k and v, ``3d·K + 3d``."""
        d, K = d_model, getattr(self, "conv_size", 0)
        return 4 * d * d + 4 * d + (3 * d * K + 3 * d if K else 0)


class MLPSpec:
    """Base of the MLP configurations (frozen dataclasses), as :class:`MixerSpec`."""

    kind: ClassVar[str] = ""
    module: ClassVar[type] = object

    def __post_init__(self) -> None:
        _check_ints(self)

    def build(self, d_model: int):
        return self.module(d_model, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def num_parameters(self, d_model: int) -> int:  # pragma: no cover - each kind overrides it
        raise NotImplementedError

    def num_active_parameters(self, d_model: int) -> int:
        """Parameters one token uses: all of them, unless the kind routes (a mixture of experts)."""
        return self.num_parameters(d_model)


def register_mixer(spec: type) -> type:
    """Register a mixer configuration class under ``spec.kind`` (usable as a decorator)."""
    if not spec.kind or spec.kind in MIXER_CONFIGS:
        raise ValueError(f"register_mixer: kind {spec.kind!r} is empty or taken")
    MIXER_CONFIGS[spec.kind], MIXERS[spec.kind] = spec, spec.module
    return spec


def register_mlp(spec: type) -> type:
    """Register an MLP configuration class under ``spec.kind`` (usable as a decorator)."""
    if not spec.kind or spec.kind in MLP_CONFIGS:
        raise ValueError(f"register_mlp: kind {spec.kind!r} is empty or taken")
    MLP_CONFIGS[spec.kind], MLPS[spec.kind] = spec, spec.module
    return spec


def mixer_config(kind: str, **fields):
    """The configuration of a mixer named by kind: ``mixer_config("deltanet", n_head=2)``."""
    if kind not in MIXER_CONFIGS:
        raise ValueError(f"unknown mixer {kind!r}; choose one of {sorted(MIXER_CONFIGS)}")
    return MIXER_CONFIGS[kind](**fields)


class HeadsSpec(MixerSpec):
    """What the configurations of the linear layers of Part IV share (:class:`~tinyk3.layers.KDAConfig`,
    :class:`~tinyk3.layers.GatedDeltaNetConfig`): ``n_head`` key heads of
    ``head_dim``, ``n_v_head`` value heads of ``v_head_dim`` (0: as many, as wide), a short
    convolution (``conv_size ≥ 1``) and an output norm's ``norm_eps``. Not a dataclass itself:
    each subclass declares the fields."""

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.conv_size < 1:
            raise ValueError(f"{name}: conv_size must be >= 1 (this layer always has a short "
                             f"convolution; 4 taps), got {self.conv_size}")
        if self.value_heads % self.n_head:
            raise ValueError(f"{name}: n_v_head ({self.n_v_head}) must be a multiple of n_head "
                             f"({self.n_head}) (each key head serves n_v_head/n_head value heads)")
        if isinstance(self.norm_eps, bool) or not (isinstance(self.norm_eps, (int, float))
                                                    and self.norm_eps > 0):
            raise ValueError(f"{name}: norm_eps must be a positive number, got {self.norm_eps!r}")
        from .forms import check_form

        check_form(self.form, self.rule, name)

    @property
    def value_heads(self) -> int:
        return self.n_v_head or self.n_head

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    def check(self, d_model: int) -> None:
        """Any ``d_model`` works: the heads' widths are set by ``head_dim``, not by ``d_model``."""
        positive_int(d_model, "d_model", type(self).__name__)
