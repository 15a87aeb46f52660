"""tinyk3: the tested package behind the course "GPT-2 to Kimi K3".

One module per mechanism, each with a slow reference form and its efficient forms:

* :mod:`tinyk3.attention` - causal softmax attention (loop, masked matrix, fused SDPA)
* :mod:`tinyk3.gpt2` - GPT-2 (chapter 1), loadable from ``transformers`` weights
* :mod:`tinyk3.kv_cache`, :mod:`tinyk3.generate` - the KV cache and decoding (chapter 2)
* :mod:`tinyk3.data`, :mod:`tinyk3.train` - offline corpus and a small training loop
* :mod:`tinyk3.checks` - the autograder for the exercises
"""

__version__ = "0.1.0"

from .notebook import setup  # noqa: E402,F401
