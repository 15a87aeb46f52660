"""The language models of the course: one interface, a token mixer chosen per layer.

:class:`LM` is GPT-2's stack (:mod:`tinyk3.gpt2`: pre-LN blocks, a GELU MLP, learned
positions (optional), a tied head, GPT-2's initialisation) with the mixer of each layer chosen
by its :class:`LMConfig`: a ``pattern`` (``"KKKA"``, or a list) over named mixer
configurations, any kind registered in :data:`tinyk3.layers.MIXER_CONFIGS` (``"softmax"``,
``"linear"``, ``"deltanet"``; Parts IV-V register more). So when chapters compare mechanisms
on the same data, only the mixer differs, and a hybrid is a pattern.

Every model keeps one interface, which :func:`tinyk3.generate.generate` uses:
``model(idx, cache=None) -> logits [B, T, V]``; ``model.new_cache()`` gives an
:class:`LMCache` (one state per layer) that the forward pass updates in place, and feeding a
sequence in pieces of any sizes through one cache gives the logits of the full forward. For
softmax attention a layer's state holds every past key and value and grows with the sequence;
for the others it has a fixed size (compare ``cache.nbytes()`` as the sequence grows).
``model.config`` is the configuration it was built from, and :func:`count_parameters` counts
the parameters of any such configuration by formula.

DeepSeek-V3 (and Kimi K2) and Qwen3-Next are too (:mod:`tinyk3.models.hub`): ``from_hf`` and
``from_checkpoint`` load them, :mod:`presets` gives the released models' configurations, and
:func:`try_checkpoint` is the chapters' optional cell that loads a published checkpoint.

GPT-2 is one of these models (:mod:`tinyk3.models.gpt2`, :func:`presets.gpt2_small`):
:func:`from_hf` loads ``transformers``' GPT-2 and :func:`~tinyk3.models.gpt2.from_gpt`
chapter 1's :class:`tinyk3.gpt2.GPT`, with the same logits (``tests/test_models.py``).

Chapters 3-5 use the flat names: ``MixerConfig(...)`` (the same mixer in every layer;
:func:`~tinyk3.models.config.mixer_config_flat`), ``MixerLM`` (= :class:`LM`) and
``MixerCache`` (= :class:`LMCache`).
"""

from __future__ import annotations

from . import presets
from .config import LMConfig, MixerConfig, mixer_config_flat
from .count import ParameterCount, count_parameters
from .demo import try_checkpoint, try_published
from .gpt2 import from_gpt
from .hf import from_checkpoint, from_hf
from .lm import LM, Block, LMCache

MixerLM = LM  # the name chapters 3-5 use
MixerCache = LMCache

__all__ = ["LM", "LMConfig", "LMCache", "Block", "count_parameters", "ParameterCount",
           "from_hf", "from_checkpoint", "from_gpt", "presets", "MixerConfig", "MixerLM",
           "MixerCache", "mixer_config_flat", "try_checkpoint", "try_published"]
