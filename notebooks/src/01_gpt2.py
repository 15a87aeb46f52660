# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # GPT-2: the 2019 baseline
#
# Every model in this course is measured against GPT-2 small, released by OpenAI in 2019 with
# 124 million parameters. Kimi K3 (2026) has about 2.8 trillion: the *22,580* in the title
# of the post this course follows is the ratio of the two,
# $2.8 \times 10^{12} / 124 \times 10^{6}$ (Check 1 below recomputes it). Before we can say
# what changed, we need the baseline in our hands.
#
# **In this chapter** you build causal self-attention from a token loop to one masked matrix
# product, assemble GPT-2 from it, count its parameters exactly, check it against the
# `transformers` implementation, and train a tiny byte-level GPT in about a minute.
#
# **Cost.** Under two minutes on one CPU core (the last cell prints the time); `SMOKE = True`
# runs in a few seconds.

# %% tags=["hide-input"]
# Setup. Where the course package is missing (Colab, Kaggle, a fresh Jupyter), install
# it from the repository without changing any package already installed: each one is
# pinned to its installed version, so pip adds only what is missing (or stops and says
# why). Locally, `make book` or `pip install -e .` has installed it. Then fix threads
# and seeds.
import importlib
import importlib.util
import subprocess
import sys
import tempfile

REPO_URL = "https://github.com/tinyk3-course/gpt2-to-kimi-k3"
PACKAGE = f"git+{REPO_URL}"
if importlib.util.find_spec("tinyk3") is None:
    pip = [sys.executable, "-m", "pip"]
    installed = subprocess.run(pip + ["list", "--format=freeze"], check=True,
                               capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pins:
        pins.write(installed)
    subprocess.run(pip + ["install", "-q", "-c", pins.name, PACKAGE], check=True)
    importlib.invalidate_caches()

import time

import tinyk3

tinyk3.setup(seed=0)
NOTEBOOK_START = time.perf_counter()

# %% tags=["parameters"]
SMOKE = False  # True: tiny sizes, for CI and the impatient

# %%
import math

import matplotlib.pyplot as plt
import torch

from tinyk3 import checks, data
from tinyk3.attention import (
    causal_attention,
    causal_attention_loop,
    causal_attention_sdpa,
)
from tinyk3.generate import generate
from tinyk3.gpt2 import GPT, GPTConfig, attention_maps, count_parameters
from tinyk3.train import train_lm
from tinyk3.util import max_diff

TRAIN_STEPS = 20 if SMOKE else 700  # about a minute on one CPU core

# %% [markdown]
# ## The idea: predict the next token, looking only backwards
#
# GPT-2 reads token ids $x_1, \dots, x_T$ and outputs, at every position $t$, a distribution
# over the next token $x_{t+1}$. The model is a stack of identical blocks between an embedding
# and a read-out:
#
# 1. **Embed.** Token id and position each select a learned vector of width $d_{\text{model}}$:
#    $h^{(0)}_t = W_{\text{te}}[x_t] + W_{\text{pe}}[t]$.
# 2. **Mix and transform, $L$ times.** Attention lets every position gather from earlier ones;
#    an MLP then transforms each position on its own.
# 3. **Read out.** A final LayerNorm, then the token-embedding matrix again (the head is *tied*)
#    gives logits over the vocabulary.
#
# Position $t$ may only look at positions $\le t$, so training can teach every position to
# predict its successor in parallel.

# %% [markdown]
# ## The math: causal self-attention
#
# Per head, with queries, keys and values $Q, K, V \in \mathbb{R}^{T \times D}$ (rows are
# positions, $D = d_{\text{model}}/H$ the head size):
#
# $$
# \operatorname{Attn}(Q, K, V) = \operatorname{softmax}\!\left(\frac{Q K^\top}{\sqrt{D}} + M\right) V,
# \qquad
# M_{ij} = \begin{cases} 0 & j \le i \\ -\infty & j > i \end{cases}
# $$
#
# The mask $M$ gives future keys a softmax weight of exactly zero. Per query, row $i$ is a
# weighted average of the values of positions $0..i$:
#
# $$
# o_i = \sum_{j \le i} \frac{\exp(q_i \cdot k_j / \sqrt{D})}{\sum_{j' \le i} \exp(q_i \cdot k_{j'} / \sqrt{D})}\, v_j .
# $$
#
# The $1/\sqrt{D}$ keeps the scores' spread independent of $D$ (for random unit-variance $q, k$,
# $q \cdot k$ has variance $D$). Tensors are laid out `[B, H, T, D]` throughout the course.

# %% [markdown]
# ## Build it in small steps
#
# **Step 1: the token loop.** The second formula, literally: for each query, a softmax over the
# keys it may see. Slow and obviously right: the reference.

# %%
def attention_by_loop(q, k, v):
    T, D = q.shape[-2], q.shape[-1]
    outs = []
    for i in range(T):
        q_i = q[..., i : i + 1, :]  # [B, H, 1, D]
        k_seen = k[..., : i + 1, :]  # [B, H, i+1, D]
        scores = q_i @ k_seen.transpose(-1, -2) / math.sqrt(D)  # [B, H, 1, i+1]
        outs.append(scores.softmax(dim=-1) @ v[..., : i + 1, :])  # [B, H, 1, D]
    return torch.cat(outs, dim=-2)  # [B, H, T, D]


# %% [markdown]
# **Step 2: one masked matrix product.** The first formula: all scores at once, future
# entries set to $-\infty$ by an upper-triangular mask.

# %%
def attention_by_mask(q, k, v):
    T, D = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # [B, H, T, T]
    # True above the diagonal
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v  # [B, H, T, D]


# %% [markdown]
# **Check.** Our two versions and the three forms of `tinyk3.attention` (the loop, the masked
# product, PyTorch's fused `scaled_dot_product_attention`) must agree with our loop to
# round-off: of order $10^{-15}$ in float64 and $10^{-7}$ in float32.

# %%
for dtype in (torch.float64, torch.float32):
    q, k, v = (torch.randn(2, 3, 50, 16, dtype=dtype) for _ in range(3))
    ref = attention_by_loop(q, k, v)
    print(f"{str(dtype):14s}"
          f" | ours, mask {max_diff(attention_by_mask(q, k, v), ref):.1e}"
          f" | lib loop {max_diff(causal_attention_loop(q, k, v), ref):.1e}"
          f" | lib mask {max_diff(causal_attention(q, k, v), ref):.1e}"
          f" | lib SDPA {max_diff(causal_attention_sdpa(q, k, v), ref):.1e}")

# %% [markdown]
# One head's weights on a tiny input: every row sums to one, and everything above the diagonal
# is exactly zero.

# %%
q, k = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
future = torch.ones(5, 5, dtype=torch.bool).triu(1)
weights = (q @ k.transpose(-1, -2) / 2).masked_fill(future, float("-inf")).softmax(-1)
print(weights[0, 0].numpy().round(3))
print("row sums:", weights[0, 0].sum(-1).numpy().round(6))

# %% [markdown]
# **Step 3: the model.** `tinyk3.gpt2` assembles the embeddings, twelve blocks, the final
# LayerNorm and the tied head around `causal_attention_sdpa`. A block is two residual updates,
# each reading a LayerNorm of the stream: the "pre-LN" placement, GPT-2's change from the
# original transformer, which lets deep stacks train stably.

# %%
from tinyk3.gpt2 import Block

tinyk3.notebook.show_source(Block.forward)

# %% [markdown]
# And the model's forward pass, with the shapes in the comments:

# %%
tinyk3.notebook.show_source(GPT.forward)

# %% [markdown]
# ## Check 1: exactly 124,439,808 parameters
#
# Count by hand, with $V$ = 50,257 tokens, $P$ = 1,024 positions, $L$ = 12 blocks and
# $d = d_{\text{model}}$ = 768:
#
# | part | parameters |
# |---|---|
# | token embedding (also the output head) | $Vd$ |
# | position embedding | $Pd$ |
# | attention, per block: $W_{qkv}$ and bias, output projection and bias | $3d^2 + 3d + d^2 + d$ |
# | MLP, per block: $d \to 4d \to d$ with biases | $8d^2 + 5d$ |
# | LayerNorms: two per block and a final one, weight and bias each | $(4L + 2)d$ |
#
# Build the model on PyTorch's `meta` device (shapes only, no memory) and compare each part
# with its formula:

# %%
config = GPTConfig()  # GPT-2 small
with torch.device("meta"):
    gpt2_small = GPT(config)

V, P, L, d = config.vocab_size, config.block_size, config.n_layer, config.n_embd
parts = {"token embedding / head": "wte", "position embedding": "wpe",
         "attention": ".attn.", "MLP": ".mlp.", "LayerNorms": "ln_"}
formula = {"token embedding / head": V * d, "position embedding": P * d,
           "attention": L * (4 * d * d + 4 * d), "MLP": L * (8 * d * d + 5 * d),
           "LayerNorms": (4 * L + 2) * d}
total = gpt2_small.num_parameters()
print(f"{'part':24s} {'measured':>12s} {'formula':>12s} {'share':>7s}")
for part, key in parts.items():
    n = sum(p.numel() for name, p in gpt2_small.named_parameters() if key in name)
    print(f"{part:24s} {n:12,d} {formula[part]:12,d} {n / total:7.1%}")
print(f"{'total':24s} {total:12,d} {count_parameters(config):12,d}")
print(f"the title's ratio: 2.8e12 / 124e6 = {2.8e12 / 124e6:,.1f}; "
      f"with the exact count, 2.8e12 / {total:,} = {2.8e12 / total:,.1f}")

# %% [markdown]
# The tied matrix is counted once; an untied head would add another $Vd$ (printed below). The
# MLPs hold twice the attention's weights, and almost a third of the model is the embedding
# table. The last line is the title's number: the post divides 2.8 trillion by 124 million;
# the exact count gives a slightly smaller ratio. nanoGPT pads the vocabulary to 50,304 (a
# multiple of 64, for faster matmuls), which changes the count:

# %% tags=["nbval-check-output"]
print(f"GPT-2 small:              {count_parameters(GPTConfig()):,}")
print(f"with vocab padded to 50,304: {count_parameters(GPTConfig(vocab_size=50304)):,}")
print(f"an untied head would add: {GPTConfig().vocab_size * GPTConfig().n_embd:,}")

# %% [markdown]
# ## Check 2: the same logits as `transformers`
#
# `GPT.from_hf` loads a Hugging Face GPT-2, undoing the transpose of its `Conv1D` weights
# (stored `[in, out]`). A tiny randomly initialised `GPT2LMHeadModel` builds offline, so the
# comparison needs no download. `transformers` is not a dependency of the course package: the
# cell says so if it is missing (CI runs the comparison in `tests/test_gpt2.py`).

# %%
try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError:
    print("transformers is not installed: skipping "
          "(pip install transformers to run it)")
else:
    torch.manual_seed(0)
    hf_config = GPT2Config(vocab_size=300, n_positions=64, n_embd=48, n_layer=2,
                           n_head=3, bos_token_id=0, eos_token_id=0)
    hf_model = GPT2LMHeadModel(hf_config).eval()
    ours = GPT.from_hf(hf_model).eval()
    idx = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        err = max_diff(hf_model(idx).logits, ours(idx))
    print(f"max |logits(transformers) - logits(tinyk3)| = {err:.1e}  (float32)")

# %% [markdown]
# ## Check 3: causality, bit for bit
#
# Change the token at position $t+1$: the outputs at positions $0..t$ must not move at all,
# not even in the last bit. The cell prints how far they moved, and how far position $t+1$
# did.

# %% tags=["nbval-check-output"]
torch.manual_seed(0)
tiny = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64))
tiny.eval()
idx = torch.randint(0, 256, (1, 32))
changed = idx.clone()
t = 20
changed[0, t + 1] = (idx[0, t + 1] + 1) % 256
with torch.no_grad():
    a, b = tiny(idx), tiny(changed)
past_moved = max_diff(a[:, : t + 1], b[:, : t + 1])
print(f"positions 0..{t}: max |change| = {past_moved:.1e} (bit-identical: "
      f"{torch.equal(a[:, : t + 1], b[:, : t + 1])})")
print(f"position {t + 1}:     max |change| = {max_diff(a[:, t + 1], b[:, t + 1]):.2f}")

# %% [markdown]
# ### The real GPT-2 (Colab only)
#
# The loader also takes OpenAI's released weights. The cell runs in Colab or with
# `TINYK3_DOWNLOAD=1` set; it downloads about 500 MB, so the offline build skips it.

# %%
import os

if tinyk3.notebook.in_colab() or os.environ.get("TINYK3_DOWNLOAD") == "1":
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    tokenizer = GPT2TokenizerFast.from_pretrained("gpt2")
    real = GPT.from_hf(GPT2LMHeadModel.from_pretrained("gpt2")).eval()
    prompt = tokenizer("The key idea of attention is", return_tensors="pt").input_ids
    out = generate(real, prompt, 40, temperature=0.8, top_k=40,
                   generator=torch.Generator().manual_seed(0))
    print(tokenizer.decode(out[0]))
else:
    print("Skipped: loading the real 124M weights downloads ~500 MB from the "
          "Hugging Face hub. Open this chapter in Colab (or set TINYK3_DOWNLOAD=1) "
          "to run it.")

# %% [markdown]
# **What the cell shows in Colab** (this website is built offline, so it shows the skip
# message): one paragraph, the prompt "The key idea of attention is" followed by 40 tokens
# that OpenAI's trained 124M model sampled through this chapter's `GPT` and `generate`:
# fluent English, if not always on topic, where the tiny model trained below produces
# fragments of words. The same weights are checked offline against `transformers` in the
# course's tests, on a randomly initialised model.

# %% [markdown]
# ## Experiment: train a tiny GPT on a laptop
#
# The same code at a toy size: bytes as tokens (vocabulary 256), 3 blocks, 4 heads,
# $d_{\text{model}} = 96$, a 64-byte context. The text is the documentation that ships inside every Python
# (`pydoc_data`), so nothing is downloaded. Two baselines to beat, in nats per byte: guessing
# uniformly ($\ln 256$), and the best model that ignores context (the entropy of the byte
# frequencies).

# %%
corpus = data.encode(data.load_corpus())
train_data, val_data = data.split(corpus, val_fraction=0.1)
freq = torch.bincount(train_data, minlength=256).double() / len(train_data)
unigram_entropy = -(freq[freq > 0] * freq[freq > 0].log()).sum().item()
print(f"corpus: {len(corpus):,} bytes "
      f"({len(train_data):,} train, {len(val_data):,} validation)")
print(f"uniform guess: {math.log(256):.3f} nats/byte; "
      f"byte frequencies alone: {unigram_entropy:.3f}")

# %% [markdown]
# Training: AdamW, batches of 32 windows of 64 bytes, a short warm-up then cosine decay
# (`tinyk3.train.train_lm`); about a minute on one core.

# %%
torch.manual_seed(0)
tiny_config = GPTConfig(vocab_size=256, block_size=64, n_layer=3, n_head=4, n_embd=96)
model = GPT(tiny_config)
print(f"{model.num_parameters():,} parameters")
result = train_lm(model, train_data, val_data, steps=TRAIN_STEPS, batch_size=32,
                  lr=3e-3, eval_every=max(1, TRAIN_STEPS // 14))
print(f"{TRAIN_STEPS} steps, {result.tokens_seen:,} tokens in {result.seconds:.0f} s "
      f"({result.tokens_seen / result.seconds:,.0f} tokens/s); "
      f"final validation loss {result.val_loss[-1]:.3f} nats/byte")

# %% mystnb={"figure": {"caption": "Training and validation cross-entropy of the tiny byte-level GPT, with two baselines that ignore context: both curves end far below the dashed byte-frequency line, so the model uses context.", "name": "fig-gpt2-training-loss"}, "image": {"alt": "Line plot of cross-entropy in nats per byte against training step from 50 to 700: the train curve starts near 3.4, just above a dashed line for the byte frequencies near 3.3, and drops steeply to about 2.5, the validation curve starts near 2.4, and both then fall steadily to about 1.6, far below the dashed line and a dotted line for the uniform guess near 5.5"}}
fig, ax = plt.subplots()
ax.plot(result.steps, result.train_loss, label="train (mean over interval)")
ax.plot(result.val_steps, result.val_loss, "o-", label="validation")
ax.axhline(math.log(256), color="gray", ls=":", label="uniform guess")
ax.axhline(unigram_entropy, color="gray", ls="--",
           label="byte frequencies (no context)")
ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)",
       title="A tiny byte-level GPT learning Python's docs")
ax.legend(loc="upper right", bbox_to_anchor=(1, 0.93))  # below the uniform-guess line
plt.show()

# %% [markdown]
# The validation loss is below the dashed line from the first evaluation on and ends far below
# it: the model uses context. Samples, at temperature 0.8 with top-k 40 (exercise 3):

# %%
prompt = data.encode('The "while" statement\n').unsqueeze(0)  # [1, T]
sample = generate(model, prompt, 300, use_cache=False, temperature=0.8, top_k=40,
                  generator=torch.Generator().manual_seed(0))
print(data.decode(sample[0]))

# %% [markdown]
# ### What do the heads look at?
#
# `tinyk3.gpt2.attention_maps` recomputes every layer's attention weights for one input. Pick a
# layer and a head with the sliders (every picture is precomputed, so they also work on the
# website). Rows are queries, columns keys, both labelled with their bytes; the empty upper
# triangle is the mask. The colour scale is a square root, so that weights of a few percent
# show.

# %%
import matplotlib.colors

from tinyk3.widgets import figure_png, image_grid_explorer

text = data.decode(val_data[1000:1048])
probe = data.encode(text).unsqueeze(0)  # [1, 48]
maps = attention_maps(model, probe)[:, 0]  # [L, H, T, T]
labels = [{"\n": "⏎", " ": "␣"}.get(ch, ch) for ch in text]


def head_png(layer, head):
    fig, ax = plt.subplots(figsize=(6.8, 6.6))
    # a square-root colour scale, so that small weights stay visible
    norm = matplotlib.colors.PowerNorm(0.5, vmin=0, vmax=1)
    image = ax.imshow(maps[layer, head], cmap="Blues", norm=norm)
    fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02, label="attention weight",
                 ticks=[0, 0.05, 0.2, 0.4, 0.6, 0.8, 1])
    ax.set_xticks(range(len(labels)), labels, fontsize=9, family="monospace")
    ax.set_yticks(range(len(labels)), labels, fontsize=9, family="monospace")
    ax.tick_params(length=0, pad=1)
    ax.grid(False)
    ax.set_xlabel("key", fontsize=12)
    ax.set_ylabel("query", fontsize=12)
    ax.set_title(f"layer {layer}, head {head}", fontsize=13)
    return figure_png(fig, colors=64)


n_layers, n_heads = maps.shape[:2]
pngs = [[head_png(l, h) for h in range(n_heads)] for l in range(n_layers)]
image_grid_explorer(pngs, "layer", "head",
                    title="Attention weights of the trained tiny GPT",
                    row_labels=range(n_layers), col_labels=range(n_heads))

# %% [markdown]
# The pictures invite stories; numbers settle them. For each head: the average weight a query
# puts on itself, on the byte just before it, and how far back it looks on average. The
# yardstick for the last is a head that spreads its weight uniformly over the keys it may see:
# query $i$ then looks back $i/2$ on average, $(T-1)/4$ over all queries.

# %%
T = maps.shape[-1]
# dist[i, j] = i - j: how far key j lies behind query i (0 for the masked j > i)
dist = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp(min=0).float()
uniform = torch.ones(T, T).tril()
uniform = uniform / uniform.sum(-1, keepdim=True)  # each query: 1/(i+1) on keys 0..i
uniform_distance = (uniform * dist).sum(-1).mean().item()
print(f"uniform causal weights over T = {T} bytes: "
      f"mean distance {uniform_distance:.2f} ((T-1)/4 = {(T - 1) / 4:.2f})")
print("layer head   self  previous  mean distance  / uniform")
for l in range(maps.shape[0]):
    for h in range(maps.shape[1]):
        w = maps[l, h]
        mean_distance = (w * dist).sum(-1).mean().item()
        print(f"{l:5d} {h:4d}  {w.diagonal().mean():5.2f}  {w.diagonal(-1).mean():8.2f}"
              f"  {mean_distance:13.1f}  {mean_distance / uniform_distance:9.2f}")

# %% [markdown]
# Heads whose mean distance is a small fraction of the uniform one (last column) look locally,
# as reading spelling needs: the query's own byte and the one before it (the self and previous
# columns) take a large share of their weight. A ratio near 1 means a head looks as far back
# as an even spread would. Which heads do which changes with the seed and the training length;
# a mix of local and wide heads is typical of byte-level models.

# %% [markdown]
# ## Exercises
#
# Each exercise is a function to write; the cell after it runs an autograder from
# `tinyk3.checks` (see [How to use this book](../book/how-to-use.md)). Solutions are folded
# below each check.
#
# ```{exercise} Causal self-attention
# :label: ex-gpt2-attention
#
# Write `causal_attention(q, k, v)` for tensors `[B, H, T, D]`, returning `[B, H, T, D]`, in
# the input's dtype, with the $1/\sqrt{D}$ scale and the causal mask. No loops over positions.
# ```

# %%
def causal_attention_mine(q, k, v):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("gpt2.causal_attention", causal_attention_mine)

# %% [markdown]
# ```{solution-start} ex-gpt2-attention
# :class: dropdown
# ```

# %%
def causal_attention_solution(q, k, v):
    T, D = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # [B, H, T, T]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(diagonal=1)
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v


ok = checks.run("gpt2.causal_attention", causal_attention_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The parameter count by formula
# :label: ex-gpt2-params
#
# Write `param_count(vocab_size, block_size, n_layer, n_embd)` returning the number of
# parameters of a GPT-2 with a tied head, without building a model. The check includes GPT-2
# small and medium and some random sizes.
# ```

# %%
def param_count_mine(vocab_size, block_size, n_layer, n_embd):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("gpt2.param_count", param_count_mine)

# %% [markdown]
# ```{solution-start} ex-gpt2-params
# :class: dropdown
# ```

# %%
def param_count_solution(vocab_size, block_size, n_layer, n_embd):
    d = n_embd  # d_model
    # attention, MLP, two LayerNorms
    per_block = (4 * d * d + 4 * d) + (8 * d * d + 5 * d) + 4 * d
    return (vocab_size + block_size) * d + n_layer * per_block + 2 * d


ok = checks.run("gpt2.param_count", param_count_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} Top-k filtering
# :label: ex-gpt2-topk
#
# Sampling at temperature 0.8 with top-k 40 (as above) first keeps only the 40 largest logits
# of each row. Write `top_k_logits(logits, k)` for `logits: [B, V]`: return a tensor of the
# same shape in which every logit smaller than the row's k-th largest is `-inf`.
# ```

# %%
def top_k_logits_mine(logits, k):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("gpt2.top_k_logits", top_k_logits_mine)

# %% [markdown]
# ```{solution-start} ex-gpt2-topk
# :class: dropdown
# ```

# %%
def top_k_logits_solution(logits, k):
    kth_largest = torch.topk(logits, k, dim=-1).values[:, -1:]  # [B, 1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


ok = checks.run("gpt2.top_k_logits", top_k_logits_solution)

# %% [markdown]
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - GPT-2 is embeddings (tokens plus learned positions), $L$ pre-LN blocks of causal attention
#   and an MLP, a final LayerNorm and a head tied to the token embedding.
# - Causal attention is $\operatorname{softmax}(QK^\top/\sqrt{D} + M)V$; its three forms agree
#   to round-off, and the model is causal bit for bit.
# - GPT-2 small has exactly 124,439,808 parameters, two thirds of each block in the MLP; Kimi
#   K3 is about 22,580 of them.
# - Our implementation reproduces `transformers`' logits, so the real weights load into it.
#
# **Next.** Generating text calls the model once per new token, recomputing the keys and
# values of every earlier token. Chapter 2 keeps them: the KV cache.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
