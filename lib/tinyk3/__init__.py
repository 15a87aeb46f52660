"""tinyk3: the tested package behind the course "GPT-2 to Kimi K3".

One module per mechanism, each with a slow reference form and its efficient forms:

* :mod:`tinyk3.attention` - causal softmax attention (loop, masked matrix, fused SDPA)
* :mod:`tinyk3.gpt2` - GPT-2 (chapter 1), loadable from ``transformers`` weights
* :mod:`tinyk3.kv_cache`, :mod:`tinyk3.generate` - the KV cache and decoding (chapter 2)
* :mod:`tinyk3.ops` - the sequence-mixing operators, each a token loop and its efficient forms
  (linear attention, the delta rule, the WY/UT transform; chapters 3 to 8)
* :mod:`tinyk3.kernels` - Triton kernels with the same contracts (chapter 9; Triton optional)
* :mod:`tinyk3.layers`, :mod:`tinyk3.models` - token mixers, blocks and language models built
  from a per-layer pattern, one interface for every model (GPT-2 included)
* :mod:`tinyk3.memory`, :mod:`tinyk3.conditioning`, :mod:`tinyk3.cost` - associative memory
  (chapter 4), the UT transform's conditioning (chapter 7), FLOP counts
* :mod:`tinyk3.data`, :mod:`tinyk3.train` - offline corpus and a small training loop
* :mod:`tinyk3.timing`, :mod:`tinyk3.bench` - the one timing helper, and the benchmarks that
  every performance claim comes from
* :mod:`tinyk3.checks` - the autograder for the exercises; :mod:`tinyk3.util` - ``max_diff``
"""

__version__ = "1.2.0"  # the release; CHANGELOG.md says what each one holds

from .notebook import setup  # noqa: E402,F401
