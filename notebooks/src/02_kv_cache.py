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
# # The KV cache
#
# Chapter 1's GPT-2 generates text one token at a time, and each new token costs a forward
# pass over everything written so far. Most of that work is repeated: the keys and values of
# earlier tokens do not change when a token is appended. The KV cache keeps them. It turns a
# decoding step into one attention row, and it introduces the quantity the rest of this
# course fights: memory that grows with every token.
#
# **In this chapter** you see why past keys and values can be reused, decode with a cache and
# prove it gives the same logits as no cache, meet the mask that appending several tokens at
# once needs, and measure time and bytes.
#
# **Cost.** Under a minute on one CPU core (the last cell prints the time).

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
import torch.nn.functional as F

from tinyk3 import checks
from tinyk3.attention import causal_attention, causal_mask
from tinyk3.bench import stamp
from tinyk3.generate import generate
from tinyk3.gpt2 import GPT, GPTConfig
from tinyk3.kv_cache import KVCache, kv_cache_bytes
from tinyk3.util import max_diff

DECODE_TOKENS = 48 if SMOKE else 512  # tokens generated in the timing experiment
GPT2_CONTEXT = 256 if SMOKE else 1024  # tokens fed to GPT-2 small to measure the cache


# %% [markdown]
# ## The idea: the past does not change
#
# In a causal model the key and value of token $j$ at every layer depend only on tokens
# $0..j$ (chapter 1's causality check). So appending token $t+1$ leaves the keys and values of
# tokens $0..t$ unchanged, and generation without a cache recomputes them at every step. On a
# small random GPT: a 30-token prefix's keys and values, alone and inside 31 tokens.

# %%
torch.manual_seed(0)
config = GPTConfig(vocab_size=256, block_size=1024, n_layer=4, n_head=4, n_embd=256)
model = GPT(config).eval()
tokens = torch.randint(0, 256, (1, 31))
short, long = model.new_cache(), model.new_cache()
with torch.no_grad():
    model(tokens[:, :30], cache=short)
    model(tokens, cache=long)
err_k = max(max_diff(short.keys[l], long.keys[l][:, :, :30]) for l in range(4))
err_v = max(max_diff(short.values[l], long.values[l][:, :, :30]) for l in range(4))
err = max(err_k, err_v)
print(f"max difference in the 30 shared positions, all layers: {err:.1e}")

# %% [markdown]
# Not always exactly zero: a product over 31 rows may be blocked differently from one over 30,
# which changes the order of float32 additions, not the mathematics.

# %% [markdown]
# ## The math: one decoding step
#
# Keep, for every layer and head, the keys and values of all tokens so far,
# $K_{\le t}, V_{\le t} \in \mathbb{R}^{t \times D}$. To decode token $t+1$, run the model on
# that token alone: each layer appends $k_{t+1}, v_{t+1}$ to the cache and attends with one
# query row:
#
# $$
# o_{t+1} = \operatorname{softmax}\!\left(\frac{q_{t+1} K_{\le t+1}^\top}{\sqrt{D}}\right) V_{\le t+1}.
# $$
#
# One new token needs no mask: every cached key is in its past. The step costs one token's
# projections and MLP plus an attention row of length $t+1$. The cache's size:
#
# $$
# \text{cache bytes} = 2 \cdot L \cdot d_{\text{model}} \cdot T \cdot B \cdot
# \text{bytes per value} \qquad (d_{\text{model}} = H \cdot D).
# $$

# %% tags=["nbval-check-output"]
small = GPTConfig()
per_token = kv_cache_bytes(small.n_layer, small.n_embd, seq_len=1)
print(f"GPT-2 small, float32: {per_token // 4:,} numbers"
      f" = {per_token:,} bytes per token")
full_context = kv_cache_bytes(small.n_layer, small.n_embd, 1024)
print(f"a full 1,024-token context: {full_context / 2**20:.1f} MiB")

# %% [markdown]
# ## Build it: the cache and the decoding loop
#
# `tinyk3.kv_cache.KVCache` is a list of `[B, H, T, D]` key and value tensors, one pair per
# layer. Attention calls `append`, which concatenates the new tokens' keys and values and
# returns everything so far:

# %%
tinyk3.notebook.show_source(KVCache.append)

# %% [markdown]
# The model reads `cache.length` to place the new tokens' positions, so
# `model(idx, cache=cache)` processes tokens that *follow* the cached ones. Decoding: run the
# prompt once (the *prefill*), then feed one token at a time.

# %%
prompt = torch.randint(0, 256, (1, 8))
cache = model.new_cache()
with torch.no_grad():
    logits = model(prompt, cache=cache)  # prefill: 8 tokens
    print(f"after prefill:  {cache}")
    for _ in range(3):
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1], greedy
        logits = model(nxt, cache=cache)  # one token in, one token of logits out
        print(f"after one step: {cache}")

# %% [markdown]
# ## Check: cached logits equal uncached logits
#
# Feed the same 64 tokens (a) all at once without a cache, (b) one at a time through a cache,
# and (c) as a prefill of 20 followed by blocks of 16, 1 and 27 tokens. All three must give
# the same logits at every position, up to float32 round-off.

# %%
tokens = torch.randint(0, 256, (2, 64))
with torch.no_grad():
    full = model(tokens)  # (a)
    cache = model.new_cache()
    one_by_one = torch.cat([model(tokens[:, t : t + 1], cache=cache)
                            for t in range(64)], dim=1)  # (b)
    cache = model.new_cache()
    spans = [(0, 20), (20, 36), (36, 37), (37, 64)]
    blocks = torch.cat([model(tokens[:, a:b], cache=cache)
                        for a, b in spans], dim=1)  # (c)
print(f"max |full - one token at a time| = {max_diff(full, one_by_one):.1e}")
print(f"max |full - prefill and blocks|   = {max_diff(full, blocks):.1e}")

# %% [markdown]
# And so `generate` produces the same tokens with and without the cache, greedy or sampled
# with the same seed; the cell counts the generated tokens that differ:

# %% tags=["nbval-check-output"]
for temperature in (0.0, 1.0):
    a = generate(model, prompt, 40, use_cache=True, temperature=temperature,
                 generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 40, use_cache=False, temperature=temperature,
                 generator=torch.Generator().manual_seed(1))
    differ = (a[:, prompt.shape[1]:] != b[:, prompt.shape[1]:]).sum().item()
    print(f"temperature {temperature}: {differ} of 40 generated tokens differ "
          "with and without the cache")

# %% [markdown]
# (erratum-cached-mask)=
# ## Erratum: a listing written for one-token decode
#
# The post's cached-attention listing is written for the two calls of plain generation, and
# its comments say so: a prefill with no cache, and decode steps of one token (`b, h, 1, d`).
# It applies the causal mask only at prefill, since one new token may see every cached key,
# and takes an optional `mask` for anything else. A caller that appends a *block* of new tokens
# to a cache (speculative decoding, chunked prefill, a multi-token turn) must pass that mask:
# without it, each new token sees the new tokens after it. The same logic, in our own minimal
# version:

# %%
def attention_as_listed(q_new, k_new, v_new, past=None, mask=None):
    """Causal mask only when there is no cache; an optional boolean `mask`
    (True: may attend) for every other case."""
    if past is None:
        k, v = k_new, v_new
    else:
        k, v = torch.cat([past[0], k_new], dim=2), torch.cat([past[1], v_new], dim=2)
    # [B, H, T_new, T_all]
    scores = q_new @ k.transpose(-1, -2) / math.sqrt(q_new.shape[-1])
    if past is None:  # prefill: the causal mask
        T = q_new.shape[2]
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


torch.manual_seed(0)
past = (torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))  # 6 cached tokens
for n_new in (1, 4):
    q_new, k_new, v_new = (torch.randn(1, 2, n_new, 8) for _ in range(3))
    k_all, v_all = torch.cat([past[0], k_new], 2), torch.cat([past[1], v_new], 2)
    right = causal_attention(q_new, k_all, v_all)
    no_mask = attention_as_listed(q_new, k_new, v_new, past)
    masked = attention_as_listed(q_new, k_new, v_new, past,
                                 mask=causal_mask(n_new, 6 + n_new))
    print(f"{n_new} new token(s): max error {max_diff(no_mask, right):.3f} without "
          f"`mask`, {max_diff(masked, right):.1e} with the bottom-right mask")

# %% [markdown]
# One new token: no error. Four without a mask: a large one, a leak from the future, which a
# probe shows directly: change only the *last* new token's value, and see whether the *first*
# new token's output moves.

# %%
v_changed = v_new.clone()
v_changed[:, :, -1] += 1.0
first_before = attention_as_listed(q_new, k_new, v_new, past)[:, :, 0]
first_after = attention_as_listed(q_new, k_new, v_changed, past)[:, :, 0]
print(f"first new token's output moved by {max_diff(first_before, first_after):.3f} "
      "when the last new token changed (must be 0)")

# %% [markdown]
# **The mask a block needs.** New token $i$ sits at absolute position $T_{\text{past}} + i$, so
# it may see keys $0..T_{\text{past}} + i$: the causal mask is aligned to the *bottom-right*
# corner of the $T_{\text{new}} \times (T_{\text{past}} + T_{\text{new}})$ score matrix,
# `tril(diagonal=T_past)`. `tinyk3.attention.causal_mask` builds it, and `tinyk3.gpt2` applies
# it on every call, so no caller has to pass it:

# %%
print(causal_mask(4, 10).int())

# %% [markdown]
# A related trap: `scaled_dot_product_attention(..., is_causal=True)` aligns its mask
# *top-left* when there are fewer queries than keys, hiding cached keys from the new tokens;
# `tinyk3.attention.causal_attention_sdpa` passes the bottom-right mask. Against the loop:

# %%
from tinyk3.attention import causal_attention_loop, causal_attention_sdpa

k_all, v_all = torch.cat([past[0], k_new], 2), torch.cat([past[1], v_new], 2)
reference = causal_attention_loop(q_new, k_all, v_all)
top_left = F.scaled_dot_product_attention(q_new, k_all, v_all, is_causal=True)
bottom_right = causal_attention_sdpa(q_new, k_all, v_all)
print(f"SDPA with is_causal=True:    max error {max_diff(top_left, reference):.3f}")
print(f"tinyk3 bottom-right mask:    max error {max_diff(bottom_right, reference):.1e}")

# %% [markdown]
# The model-level check above (prefill then blocks of 16 and 27 tokens) passes because of that
# mask. This entry is on the [errata page](../book/errata.md).

# %% [markdown]
# ## Experiment 1: decoding time, with and without the cache
#
# Generate tokens greedily from a 16-token prompt with a 4-layer, width-256 GPT and time
# every step. Without the cache, step $t$ is a forward pass over $16 + t$ tokens, so its time
# grows with $t$ and the total quadratically. With it, each step is one token through the
# model plus an attention row that grows with $t$, so its time grows far more slowly (the fit
# after the figure measures both). About 20 seconds (the cell prints both totals), nearly all
# of it without the cache.
#
# What is measured is each step's latency as the context grows, so `timed_decode` reads the
# clock around every step of one run; `tinyk3.timing.time_fn`, the book's timer elsewhere,
# would repeat one call at one context length. A short run first warms both paths up.

# %%
def timed_decode(model, prompt, n_tokens, use_cache):
    """Greedy decoding; returns the seconds each step took."""
    seq, cache = prompt, (model.new_cache() if use_cache else None)
    step_input, seconds = prompt, []
    with torch.no_grad():
        for _ in range(n_tokens):
            t0 = time.perf_counter()
            logits = model(step_input, cache=cache)[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            seconds.append(time.perf_counter() - t0)
            seq = torch.cat([seq, nxt], dim=1)
            step_input = nxt if use_cache else seq
    return torch.tensor(seconds)


prompt = torch.randint(0, 256, (1, 16))
timed_decode(model, prompt, 8, True), timed_decode(model, prompt, 8, False)  # warm-up
with_cache = timed_decode(model, prompt, DECODE_TOKENS, use_cache=True)
without_cache = timed_decode(model, prompt, DECODE_TOKENS, use_cache=False)
speedup = without_cache.sum() / with_cache.sum()
print(f"{DECODE_TOKENS} tokens: {without_cache.sum():.2f} s without the cache, "
      f"{with_cache.sum():.2f} s with it ({speedup:.1f}x faster)")
print(stamp())

# %% mystnb={"figure": {"caption": "Greedy decoding time with and without the KV cache. Without it each step re-reads the whole prefix, so the step time grows linearly and the total quadratically; with it the step time stays low and grows far more slowly, and the total grows almost linearly. The cell above prints the totals.", "name": "fig-kv-decode-time"}, "image": {"alt": "Two line plots against the number of generated tokens. Left: time per step in milliseconds, rising steadily without the cache and flat near the bottom with it. Right: cumulative time in seconds, a curve bending upwards without the cache and a shallow straight line with it"}}
steps = torch.arange(1, DECODE_TOKENS + 1)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6.8, 3.2))
ax1.plot(steps, without_cache * 1e3, label="without cache")
ax1.plot(steps, with_cache * 1e3, label="with cache")
ax1.set(xlabel="generated token", ylabel="time per step (ms)", title="Each step")
ax2.plot(steps, without_cache.cumsum(0), label="without cache")
ax2.plot(steps, with_cache.cumsum(0), label="with cache")
ax2.set(xlabel="tokens generated", ylabel="total time (s)", title="Cumulative")
for ax in (ax1, ax2):
    ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# How each grows: a straight-line fit of step time against position gives the cost per token
# of context, and the last quarter of the steps against the first how much slower late steps
# are.

# %%
# columns of the least-squares fit: time = slope * position + intercept
design = torch.stack([steps.double(), torch.ones(len(steps), dtype=torch.double)], 1)
for name, t in (("without cache", without_cache), ("with cache", with_cache)):
    slope = torch.linalg.lstsq(design, t.double()[:, None]).solution[0, 0].item()
    q = len(t) // 4
    print(f"{name:14s} +{slope * 1e6:7.2f} µs per step per token of context; "
          f"last quarter / first quarter = {t[-q:].median() / t[:q].median():.1f}x")

# %% [markdown]
# ## Experiment 2: the bytes the cache costs
#
# GPT-2 small itself, randomly initialised (the cache's size does not depend on the weights):
# push tokens through it in blocks of 128 and read the cache's size after each, next to the
# formula; a few seconds (the cell prints its time).

# %%
t0 = time.perf_counter()
torch.manual_seed(0)
gpt2_small = GPT(GPTConfig()).eval()
weight_bytes = sum(p.numel() * p.element_size() for p in gpt2_small.parameters())
cache = gpt2_small.new_cache()
lengths, measured = [], []
with torch.no_grad():
    for _ in range(0, GPT2_CONTEXT, 128):
        gpt2_small(torch.randint(0, 50257, (1, 128)), cache=cache)
        lengths.append(cache.length)
        measured.append(cache.nbytes())
analytic = [kv_cache_bytes(12, 768, n) for n in lengths]
print(f"{'tokens':>6s} {'measured bytes':>15s} {'formula':>15s}")
for n, m, a in zip(lengths, measured, analytic):
    print(f"{n:6d} {m:15,d} {a:15,d}")
off_by = max(abs(m - a) for m, a in zip(measured, analytic))
print(f"max |measured - formula| over the lengths: {off_by:,d} bytes "
      f"({time.perf_counter() - t0:.0f} s)")

# %% mystnb={"figure": {"caption": "KV cache size of GPT-2 small against context length, by the formula for three batch sizes and as measured: the cache grows linearly with the tokens held and passes the size of the weights (dashed) once batch and context are large enough.", "name": "fig-kv-cache-size"}, "image": {"alt": "Line plot on linear axes of MiB against tokens in context from 32 to 1024: three straight lines from the origin for batch 1, 8 and 32, the batch 1 line close to the x axis with black dots on it for the measured sizes, and a dashed horizontal line at the size of the weights, which the batch 32 line crosses near 200 tokens and the batch 8 line near 850, while the batch 1 line stays far below it"}}
batch_sizes = [1, 8, 32]
fig, ax = plt.subplots()
xs = torch.arange(32, 1025, 32)
for b in batch_sizes:
    mib = [kv_cache_bytes(12, 768, int(x), b) / 2**20 for x in xs]
    ax.plot(xs, mib, label=f"formula, batch {b}")
ax.plot(lengths, [m / 2**20 for m in measured], "ko", label="measured, batch 1")
ax.axhline(weight_bytes / 2**20, color="gray", ls="--", label="the weights themselves")
ax.set(xlabel="tokens in context", ylabel="MiB (float32)",
       title="GPT-2 small: KV cache size")
ax.set_xlim(left=0)
ax.set_ylim(bottom=0)
ax.legend(loc="upper left")
plt.show()
break_even = weight_bytes / kv_cache_bytes(12, 768, 1)
print(f"weights: {weight_bytes / 2**20:.0f} MiB; the cache outgrows them after "
      f"{break_even:,.0f} tokens in total (e.g. batch {math.ceil(break_even / 1024)} "
      "at the full 1,024-token context)")
print(f"at Kimi K3's context of 1,048,576 tokens, GPT-2 small's cache alone would be "
      f"{kv_cache_bytes(12, 768, 2**20) / 1e9:.0f} GB (float32, one sequence)")

# %% [markdown]
# At GPT-2's 1,024 tokens the cache is modest. At Kimi K3's million-token contexts even this
# small model's cache would be tens of gigabytes (the last line above), and it grows with
# every layer and head of a larger model. Chapters 3 to 5 replace the growing cache by a
# fixed-size state; chapter 13 shrinks it by caching a compressed latent instead.

# %% [markdown]
# ## Exercises
#
# ```{exercise} Attention over a cache
# :label: ex-kv-attend
#
# Write `attend_with_cache(q_new, k_cache, v_cache, k_new, v_new)`. The `T_new` new tokens
# follow `T_past` cached ones (all tensors `[B, H, T, D]`); return the new tokens' attention
# outputs `[B, H, T_new, D]`. The check includes blocks of several new tokens.
# ```

# %%
def attend_with_cache_mine(q_new, k_cache, v_cache, k_new, v_new):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("kv_cache.attend_with_cache", attend_with_cache_mine)

# %% [markdown]
# ```{solution-start} ex-kv-attend
# :class: dropdown
# ```

# %%
def attend_with_cache_solution(q_new, k_cache, v_cache, k_new, v_new):
    k = torch.cat([k_cache, k_new], dim=2)  # [B, H, T_past + T_new, D]
    v = torch.cat([v_cache, v_new], dim=2)
    T_past, T_new = k_cache.shape[2], q_new.shape[2]
    # [B, H, T_new, T_all]
    scores = q_new @ k.transpose(-1, -2) / math.sqrt(q_new.shape[-1])
    allowed = torch.ones(T_new, T_past + T_new, dtype=torch.bool).tril(diagonal=T_past)
    return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v


ok = checks.run("kv_cache.attend_with_cache", attend_with_cache_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The size of a KV cache
# :label: ex-kv-bytes
#
# Write `cache_bytes(n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value)`: the
# bytes a KV cache needs. Then use it: how many tokens of GPT-2 XL (48 layers, 25 heads of 64)
# fit in 80 GB in bfloat16?
# ```

# %%
def cache_bytes_mine(n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("kv_cache.cache_bytes", cache_bytes_mine)

# %% [markdown]
# ```{solution-start} ex-kv-bytes
# :class: dropdown
# ```

# %%
def cache_bytes_solution(n_layer, n_head, head_dim, seq_len, batch_size,
                         bytes_per_value):
    return 2 * n_layer * n_head * head_dim * seq_len * batch_size * bytes_per_value


ok = checks.run("kv_cache.cache_bytes", cache_bytes_solution)
xl_per_token = cache_bytes_solution(48, 25, 64, 1, 1, 2)
print(f"GPT-2 XL, bfloat16: {80e9 / xl_per_token:,.0f} tokens in 80 GB")

# %% [markdown]
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - Past keys and values never change in a causal model, so decoding keeps them: a step is
#   one token through the model and one attention row over the cache, with the same logits.
# - Appending a *block* of tokens needs the causal mask aligned bottom-right
#   (`tril(diagonal=T_past)`); a listing that masks only at prefill leaves it to the caller.
# - The cache costs $2 \cdot L \cdot d_{\text{model}}$ values per token, without bound.
#
# **Next.** Part II asks whether attention needs a cache that grows at all: linear attention
# folds all past keys and values into a fixed-size state.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
