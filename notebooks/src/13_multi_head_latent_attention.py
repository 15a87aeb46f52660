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
# # Multi-head latent attention
#
# Chapter 2's KV cache made decoding cheap in arithmetic and expensive in memory: every new token
# reads the keys and values of every earlier token, in every layer and head. Kimi K3 keeps such a
# cache in about a quarter of its layers, and those are not GPT-2's layers: they are **multi-head
# latent attention** (MLA; DeepSeek-AI, *DeepSeek-V2*, arXiv 2405.04434), which DeepSeek-V3 and Kimi K2
# use in every layer and Kimi Linear in its full-attention layers. MLA caches one compressed
# vector per token, shared by all heads, and never expands it back into per-head keys and
# values while decoding.
#
# **In this chapter** you count what a decoding step reads; build MLA from its equations (the
# latent $c_t$, the one shared rotary key, the low-rank query); derive *weight absorption*,
# which folds the key's up-projection into the query and applies the value's after the softmax,
# and check that decoding from the latent cache equals full attention; show numerically why
# RoPE cannot be put on the compressed keys, and what DeepSeek's interleaved RoPE and the
# position-free (NoPE) MLA of Kimi Linear and K3 change; check the layer against `transformers`'
# DeepSeek-V3 attention; and measure cache bytes at the sizes of real models, and the time of
# absorbed decoding against a cache of expanded keys and values.
#
# **Cost.** Under half a minute on one CPU core, most of it importing `transformers` and
# timing the decoding steps (the last cell prints the time); `SMOKE = True` runs faster.

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
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch

from tinyk3 import bench, checks
from tinyk3.layers.mla import MultiHeadLatentAttention
from tinyk3.layers.rope import rope
from tinyk3.models import presets
from tinyk3.timing import distinguishable, time_fn
from tinyk3.util import max_diff

F64, F32 = torch.float64, torch.float32
CONTEXTS = [128, 512] if SMOKE else [256, 1024, 4096, 16384]  # decode-time experiment
TIME_HEADS = 4 if SMOKE else 8  # heads of the timed layer (DeepSeek-V3's head sizes)
DISTANCES = {}  # every distance this chapter measures, for the summary


def mla_spec(cfg):
    """The MLA configuration of a model's first MLA layer."""
    return [s for s in cfg.layer_mixers if s.kind == "mla"][0]



# %% [markdown]
# ## What a decoding step reads
#
# Decoding one token at layer $\ell$ computes one query per head and scores it against the
# cached keys of all $T$ earlier tokens, then averages their cached values. In multi-head
# attention (MHA) with $H$ heads of key width $D_k$ and value width $D_v$, the cache holds
#
# $$
# H\,(D_k + D_v) \text{ values per token and layer,}
# $$
#
# $2 d_{\text{model}}$ for GPT-2, and each step reads all of them to do about two flops with each
# (a multiply and an add, for the score or the weighted sum). That is far less arithmetic per
# byte than a GPU can do: at long contexts decoding waits on memory, and the cache, not the
# weights, decides how many sequences fit beside the model (chapter 2 measured it). Grouped-query
# attention (GQA) shares one key and value head among a group of query heads, and multi-query
# attention (MQA) one among all of them. MLA takes another road: it caches a compressed latent
# from which every head's own key and value are re-created.
#
# DeepSeek-V3 has 128 heads with keys of $128 + 64 = 192$ and values of 128 channels. Its MLA
# layer caches 576 numbers per token instead (the preset `presets.deepseek_v3()` holds the
# released configuration):

# %%
ds3 = presets.deepseek_v3()
spec = mla_spec(ds3)
Dk = spec.qk_nope_head_dim + spec.qk_rope_head_dim  # a head's key width
per_head_kv = spec.n_head * (Dk + spec.v_head_dim)
latent = spec.state_numel(1, 1)  # one sequence, one token, one layer
print(f"DeepSeek-V3: {spec.n_head} heads, key {spec.qk_nope_head_dim} + "
      f"{spec.qk_rope_head_dim}, value {spec.v_head_dim}")
print(f"per-head K and V: {spec.n_head} × ({Dk} + {spec.v_head_dim}) = "
      f"{per_head_kv:,} values per token and layer")
print(f"MLA cache:        {spec.kv_lora_rank} + {spec.qk_rope_head_dim} = {latent:,} "
      f"values per token and layer: {per_head_kv / latent:.1f}x fewer")
n_mla = sum(s.kind == "mla" for s in ds3.layer_mixers)
ctx = 128 * 1024
gb = {name: n * n_mla * ctx * 2 / 1e9
      for name, n in (("kv", per_head_kv), ("mla", latent))}
print(f"at {ctx:,} tokens, {n_mla} layers, bf16: per-head K and V {gb['kv']:.0f} GB, "
      f"MLA {gb['mla']:.1f} GB per sequence")

# %% [markdown]
# ## The latent: one compressed vector per token
#
# Notation for this chapter (rows, as everywhere in the course). $x_t \in \mathbb{R}^{1 \times d}$
# is token $t$'s input ($d = d_{\text{model}}$); per head $h$ the key has a position-free part of
# $d_n$ channels (`qk_nope_head_dim`) and a rotary part of $d_r$ (`qk_rope_head_dim`), the
# value $d_v$ (`v_head_dim`); $r$ is the latent width (`kv_lora_rank`, 512) and $r_q$ the
# query's (`q_lora_rank`). $\operatorname{RoPE}_t$ rotates a row by position $t$.
#
# **Keys and values** come from one down-projection, normalised: the **latent**
#
# $$
# c_t = \operatorname{RMSNorm}(x_t W_{DKV}) \in \mathbb{R}^{1 \times r},
# $$
#
# and one **shared rotary key**, the same for every head, $k^R_t = \operatorname{RoPE}_t(x_t W_{KR})
# \in \mathbb{R}^{1 \times d_r}$. Each head expands the latent with its own up-projections,
# $W_{UK}^{(h)} \in \mathbb{R}^{d_n \times r}$ and $W_{UV}^{(h)} \in \mathbb{R}^{r \times d_v}$:
#
# $$
# k^{(h)}_t = \big[\, c_t W_{UK}^{(h)\top},\; k^R_t \,\big] \in \mathbb{R}^{1 \times (d_n + d_r)},
# \qquad v^{(h)}_t = c_t\, W_{UV}^{(h)} \in \mathbb{R}^{1 \times d_v} .
# $$
#
# ($W_{UK}^{(h)}$ is stored $d_n \times r$, as DeepSeek-V2 writes it, so that it multiplies the
# query from the right below.) The cache holds $c_t$ and $k^R_t$: $r + d_r$ numbers per token.
#
# **Queries** take a low-rank path too, $c^Q_t = \operatorname{RMSNorm}(x_t W_{DQ}) \in
# \mathbb{R}^{1 \times r_q}$, then per head $[q^{(h)}_{n,t},\, q^{(h)}_{r,t}] = c^Q_t W_{UQ}^{(h)}$,
# with the rotary part rotated, $q^{(h)}_{r,t} \leftarrow \operatorname{RoPE}_t(q^{(h)}_{r,t})$.
# Head $h$ then attends as usual, with the scale of its key width:
#
# $$
# o^{(h)}_t = \sum_{s \le t} \operatorname{softmax}_s\!\Big(\frac{q^{(h)}_t k^{(h)\top}_s}{\sqrt{d_n + d_r}}\Big)\, v^{(h)}_s,
# \qquad y_t = [o^{(1)}_t, \dots, o^{(H)}_t]\, W_O .
# $$
#
# In `transformers` and in the checkpoints, $W_{DKV}$ and $W_{KR}$ are one matrix
# (`kv_a_proj_with_mqa`, $d \to r + d_r$), the $W_{UK}^{(h)}$ and $W_{UV}^{(h)}$ of all heads one
# more (`kv_b_proj`, $r \to H (d_n + d_v)$), and $W_{DQ}$, $W_{UQ}$ are `q_a_proj`, `q_b_proj`.
# The equations, written out at a small size (with DeepSeek's interleaved RoPE, which a later
# section explains, or none: `use_rope=False`):

# %%
def init_mla(d, H, r, dn, dr, dv, rq, *, seed, dtype=F64, use_rope=True):
    """Random weights of one MLA layer, matrices that multiply rows from the right."""
    gen = torch.Generator().manual_seed(seed)

    def w(n_in, n_out):
        return torch.randn(n_in, n_out, generator=gen, dtype=dtype) / math.sqrt(n_in)

    def norm(n):  # RMSNorm weights near 1
        return 1 + 0.2 * torch.randn(n, generator=gen, dtype=dtype)

    return dict(H=H, r=r, dn=dn, dr=dr, dv=dv, use_rope=use_rope,
                W_DQ=w(d, rq), w_q=norm(rq), W_UQ=w(rq, H * (dn + dr)),
                W_DKV=w(d, r), w_kv=norm(r), W_KR=w(d, dr),
                W_UKV=w(r, H * (dn + dv)), W_O=w(H * dv, d))


def rms_norm(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def split_heads(y, H):  # [B, T, H·D] -> [B, H, T, D]
    return y.view(y.shape[0], y.shape[1], H, -1).transpose(1, 2)


def rotate(x, positions, P):
    """DeepSeek's interleaved RoPE, or nothing for a NoPE layer."""
    return rope(x, positions, interleaved=True) if P["use_rope"] else x


def queries(x, P, start):
    """q_nope [B, H, T, dn] and the rotated q_rope [B, H, T, dr], via c^Q."""
    positions = torch.arange(start, start + x.shape[1])
    q = split_heads(rms_norm(x @ P["W_DQ"], P["w_q"]) @ P["W_UQ"], P["H"])
    q_nope, q_rope = q.split([P["dn"], P["dr"]], dim=-1)
    return q_nope, rotate(q_rope, positions, P)


def latents(x, P, start):
    """What the cache keeps: c [B, T, r] and the shared key k_rope [B, T, dr]."""
    positions = torch.arange(start, start + x.shape[1])
    c = rms_norm(x @ P["W_DKV"], P["w_kv"])
    return c, rotate(x @ P["W_KR"], positions, P)


def up_projections(P):
    """W_UK [H, dn, r] and W_UV [H, r, dv]: the two halves of kv_b_proj, per head."""
    W = P["W_UKV"].view(P["r"], P["H"], P["dn"] + P["dv"])
    return W[..., : P["dn"]].permute(1, 2, 0), W[..., P["dn"]:].permute(1, 0, 2)


def causal_softmax(s):
    """softmax over the keys; query i sees keys j ≤ i + S − T (bottom-right)."""
    T, S = s.shape[-2:]
    keep = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    return s.masked_fill(~keep, -math.inf).softmax(-1)


def attend_naive(q_nope, q_rope, c, k_rope, P):
    """Expand the latents into per-head keys and values, then ordinary attention."""
    W_UK, W_UV = up_projections(P)
    k_nope = torch.einsum("bsr,hnr->bhsn", c, W_UK)  # c W_UKᵀ       [B, H, S, dn]
    v = torch.einsum("bsr,hrv->bhsv", c, W_UV)  # c W_UV           [B, H, S, dv]
    k_r = k_rope[:, None].expand(-1, P["H"], -1, -1)  # one key for all heads
    k = torch.cat([k_nope, k_r], dim=-1)  # [B, H, S, dn + dr]
    q = torch.cat([q_nope, q_rope], dim=-1)
    return causal_softmax(q @ k.mT / math.sqrt(P["dn"] + P["dr"])) @ v


def mla(x, P, cache=None, attend=attend_naive):
    """One MLA layer; cache = (c, k_rope) of the tokens before x, or None."""
    start = 0 if cache is None else cache[0].shape[1]
    q_nope, q_rope = queries(x, P, start)
    c, k_rope = latents(x, P, start)
    if cache is not None:
        c, k_rope = torch.cat([cache[0], c], 1), torch.cat([cache[1], k_rope], 1)
    o = attend(q_nope, q_rope, c, k_rope, P)  # [B, H, T, dv]
    y = o.transpose(1, 2).flatten(2) @ P["W_O"]  # heads side by side, then W_O
    return y, (c, k_rope)


SIZES = dict(d=64, H=4, r=32, dn=16, dr=8, dv=12, rq=48)  # r > dn, dv ≠ dn
P = init_mla(**SIZES, seed=0)
x = torch.randn(2, 11, SIZES["d"], dtype=F64)
y, (c, k_rope) = mla(x, P)
print(f"y {list(y.shape)}; cache: c {list(c.shape)}, k_rope {list(k_rope.shape)} "
      f"= {c.shape[-1] + k_rope.shape[-1]} values per token")

# %% [markdown]
# **The low-rank query** does not shrink the cache (queries are not cached): it saves weights,
# and activation memory in training (the reason DeepSeek-V2 gives). At DeepSeek-V3's sizes,
# against one full-rank $d \times H (d_n + d_r)$ query projection:

# %%
d = ds3.n_embd
q_width = spec.n_head * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
full_rank = d * q_width
low_rank = d * spec.q_lora_rank + spec.q_lora_rank + spec.q_lora_rank * q_width
print(f"d = {d:,}, q_lora_rank = {spec.q_lora_rank:,}, H (dn + dr) = {q_width:,}")
print(f"full-rank query: {full_rank / 1e6:.1f}M weights per layer; low-rank (W_DQ, "
      f"its norm, W_UQ): {low_rank / 1e6:.1f}M, {full_rank / low_rank:.1f}x fewer")

# %% [markdown]
# ## Weight absorption
#
# Written as above, decoding from the latent cache would expand all $T$ cached latents into
# $H$ keys and values at every step: $2 T r H (d_n + d_v)$ flops, far more than the attention
# itself. Expand the score instead. For head $h$, query $t$ and cached token $s$,
#
# $$
# q^{(h)}_t k^{(h)\top}_s = q^{(h)}_{n,t} \big(c_s W_{UK}^{(h)\top}\big)^\top + q^{(h)}_{r,t} k^{R\top}_s
# = \underbrace{\big(q^{(h)}_{n,t} W_{UK}^{(h)}\big)}_{\tilde q^{(h)}_t \in\, \mathbb{R}^{1 \times r}} c_s^\top
# + q^{(h)}_{r,t} k^{R\top}_s .
# $$
#
# $W_{UK}^{(h)}$ is **absorbed into the query**: one $d_n \times r$ product per query, after
# which every head scores its $r$-wide $\tilde q^{(h)}_t$ against the latents themselves. (It
# can be folded further, into $W_{UQ}$, once and for all: $W_{UQ,n}^{(h)} W_{UK}^{(h)}$ is an
# $r_q \times r$ matrix.) The values go the same way, since the attention weights
# $p^{(h)}_{ts}$ are numbers:
#
# $$
# o^{(h)}_t = \sum_s p^{(h)}_{ts}\, c_s W_{UV}^{(h)} = \Big(\sum_s p^{(h)}_{ts}\, c_s\Big) W_{UV}^{(h)} :
# $$
#
# average the latents, then apply $W_{UV}^{(h)}$ once per query, after the softmax (and it can
# be folded into $W_O$). Seen this way, absorbed MLA is **multi-query attention** with one key
# of $r + d_r = 576$ channels, $[c_s, k^R_s]$, and one value of $r = 512$, shared by all 128
# heads, each head with its own query; the scale stays $1/\sqrt{d_n + d_r}$, the one the model
# was trained with.

# %%
def attend_absorbed(q_nope, q_rope, c, k_rope, P):
    """The same attention, latents never expanded: W_UK into q, W_UV after."""
    W_UK, W_UV = up_projections(P)
    B, H, T, _ = q_nope.shape
    q_lat = (q_nope @ W_UK).reshape(B, H * T, -1)  # q̃ = q_nope W_UK     [B, H·T, r]
    # one key for all heads: the H·T query rows meet c and k^R in one product each
    s = q_lat @ c.mT + q_rope.reshape(B, H * T, -1) @ k_rope.mT  # [B, H·T, S]
    p = causal_softmax(s.view(B, H, T, -1) / math.sqrt(P["dn"] + P["dr"]))
    o_lat = p.view(B, H * T, -1) @ c  # Σ_s p_ts c_s, per head and query   [B, H·T, r]
    return o_lat.view(B, H, T, -1) @ W_UV  # then W_UV                    [B, H, T, dv]


y_naive, _ = mla(x, P)
y_abs, _ = mla(x, P, attend=attend_absorbed)
DISTANCES["absorbed vs naive, float64"] = max_diff(y_abs, y_naive)
P32 = {k: v.float() if torch.is_tensor(v) else v for k, v in P.items()}
y_abs32, _ = mla(x.float(), P32, attend=attend_absorbed)
DISTANCES["absorbed (float32) vs naive (float64)"] = max_diff(y_abs32, y_naive)
print(f"absorbed vs naive, float64:            max |Δy| "
      f"{DISTANCES['absorbed vs naive, float64']:.1e}")
print(f"absorbed in float32 vs naive, float64: max |Δy| "
      f"{DISTANCES['absorbed (float32) vs naive (float64)']:.1e} (max |y| "
      f"{y_naive.abs().max():.2f}; stated tolerance 1e-5)")
assert DISTANCES["absorbed vs naive, float64"] < 1e-12
assert DISTANCES["absorbed (float32) vs naive (float64)"] < 1e-5

# %% [markdown]
# The float64 forms differ by rounding; float32 is off by its own rounding, a few parts in
# $10^7$ of the largest output. **Decoding from the latent cache** feeds a prefix at once,
# then the rest token by token, with only $(c, k^R)$ carried from step to step. It must give
# the outputs of the full forward at every split point, including the first token alone and a
# prefix of everything but one:

# %%
T = x.shape[1]
worst = 0.0
for split in (1, 4, T - 1):
    y_pre, cache = mla(x[:, :split], P, attend=attend_absorbed)
    outs = [y_pre]
    for t in range(split, T):
        y_t, cache = mla(x[:, t: t + 1], P, cache=cache, attend=attend_absorbed)
        outs.append(y_t)
    err = max_diff(torch.cat(outs, 1), y_naive)
    worst = max(worst, err)
    print(f"prefill {split:2d} tokens, decode {T - split:2d}: max |Δy| against the "
          f"full forward {err:.1e}; cache {list(cache[0].shape)} + "
          f"{list(cache[1].shape)}")
DISTANCES["latent-cache decoding vs full forward, float64"] = worst
assert worst < 1e-12

# %% [markdown]
# What absorption costs and saves per decoding step, counted at DeepSeek-V3's sizes with $2mkn$
# flops for an $[m, k] \times [k, n]$ product, one query token and one sequence. The
# alternative a model without a latent has is MHA's cache of expanded keys and values, $H(d_n +
# d_r + d_v)$ numbers per token; the absorbed step reads the latent cache, $r + d_r$ per token,
# and multiplies the query by $W_{UK}$ and the averaged latent by $W_{UV}$. A third way, the
# naive one, keeps the latent cache and expands all of it at every step: correct, and by far
# the slowest (last column).

# %%
def decode_cost(T, H, r, dn, dr, dv, form):
    """(flops, cached numbers read) of one decoding step of one layer's attention."""
    if form == "expanded cache":  # MHA: scores and weighted sum over cached K and V
        return 2 * H * T * (dn + dr + dv), H * T * (dn + dr + dv)
    if form == "absorbed":
        return 2 * H * (dn * r + T * (r + dr) + T * r + r * dv), T * (r + dr)
    expand = 2 * T * r * H * (dn + dv)  # "naive": expand the latent cache, then MHA
    return expand + 2 * H * T * (dn + dr + dv), T * (r + dr)


dims = dict(H=spec.n_head, r=spec.kv_lora_rank, dn=spec.qk_nope_head_dim,
            dr=spec.qk_rope_head_dim, dv=spec.v_head_dim)
for T_ in (4096, 131072):
    (fe, be), (fa, ba), (fn, _) = (decode_cost(T_, **dims, form=f_) for f_ in
                                   ("expanded cache", "absorbed", "naive"))
    print(f"T = {T_:>7,}, per step and layer: absorbed {fa / fe:.1f}x the flops of "
          f"the expanded cache ({fa / 1e9:.2f} against {fe / 1e9:.2f} GFLOP) and "
          f"{be / ba:.0f}x fewer bytes read; naive {fn / fa:.0f}x the flops of "
          f"absorbed")
r_, dn_, dr_, dv_ = dims["r"], dims["dn"], dims["dr"], dims["dv"]
prefill_ratio = (2 * r_ + dr_) / (dn_ + dr_ + dv_)  # per query-key pair, per head
print(f"prefill (T queries): absorbed attention costs {prefill_ratio:.1f}x the flops "
      f"of expanded keys and values, (2r + dr) / (dn + dr + dv) per pair")

# %% [markdown]
# Absorbed, every cached number is read once and used by all $H$ heads, where MHA uses each of
# its cached numbers in one head only: more arithmetic, far fewer bytes. At a decoding step,
# which does a few flops per number read, the bytes decide on a GPU (Experiment 2 measures the
# trade on a CPU). For a prompt processed all at once (prefill) the balance
# turns: with $T$ queries, every query-key pair costs $2(2r + d_r)$ flops per head absorbed
# against $2(d_n + d_r + d_v)$ expanded (the multiple in the last line), while expanding costs
# $2TrH(d_n + d_v)$ once, not per query. vLLM's MLA backend
# (`vllm/v1/attention/backends/mla/common.py`) therefore expands for prefill (its "compute
# friendly" path) and absorbs for decoding (the "data-movement friendly" one); both are exact,
# so the choice is about speed alone.

# %% [markdown]
# ## Why RoPE cannot go on the compressed keys
#
# Absorption rests on one fact: between $q^{(h)}_{n,t}$ and $c_s$ there is a single matrix,
# $W_{UK}^{(h)}$, the same for every pair of positions. Suppose instead the rotation were applied
# to the keys expanded from the latent, as in an ordinary RoPE layer: $k^{(h)}_s =
# \operatorname{RoPE}_s(c_s W_{UK}^{(h)\top})$. With $\operatorname{RoPE}_t(z) = z R_t$, $R_t$ an
# orthogonal matrix of $2 \times 2$ rotations and $R_t R_s^\top = R_{t-s}$,
#
# $$
# \operatorname{RoPE}_t(q_t)\, \operatorname{RoPE}_s(c_s W_{UK}^\top)^\top
# = q_t R_t R_s^\top W_{UK}\, c_s^\top = q_t\, \big(R_{t-s} W_{UK}\big)\, c_s^\top .
# $$
#
# The matrix between query and latent now depends on the distance $t - s$: one per distance,
# which is expanding the keys under another name. Folding one matrix into the query, as
# absorption does, must then be wrong. Numerically, with rotary keys of the full $d_n$ width and
# no decoupled part:

# %%
dn = SIZES["dn"]
W_UK, _ = up_projections(P)
q_nope, _ = queries(x, P, 0)
c, _ = latents(x, P, 0)
positions = torch.arange(T)
q_rot = rope(q_nope, positions, interleaved=True)  # RoPE on the whole query ...
k_nope = torch.einsum("bsr,hnr->bhsn", c, W_UK)  # c W_UKᵀ
k_rot = rope(k_nope, positions, interleaved=True)  # ... and on the expanded keys
s_true = q_rot @ k_rot.mT  # what this layer would compute          [B, H, T, T]
attempts = {
    "fold W_UK into the rotated query": (q_rot @ W_UK) @ c[:, None].mT,
    "rotate the latents instead": (q_rot @ W_UK)
    @ rope(c, positions, interleaved=True)[:, None].mT,
}
scale = s_true.abs().max().item()
for name, s_try in attempts.items():
    print(f"{name:>34s}: max |Δs| / max |s| = {max_diff(s_try, s_true) / scale:.2f}")
eye = torch.eye(dn, dtype=F64)
R = {t: rope(eye, torch.full((dn,), t), interleaved=True) for t in range(-T + 1, T)}
s_dist = torch.empty_like(s_true)  # one matrix R_{t−s} W_UK per distance
for t in range(T):
    for s_ in range(T):
        s_dist[:, :, t, s_] = torch.einsum("bhn,hnr,br->bh", q_nope[:, :, t],
                                           R[t - s_] @ W_UK, c[:, s_])
err = max_diff(s_dist, s_true) / scale
print(f"{'one matrix R_(t−s) W_UK per distance':>34s}: max |Δs| / max |s| = {err:.1e}")

# %% [markdown]
# Both one-matrix attempts are off by the size of the scores themselves; the per-distance
# matrices are exact and are what absorption was meant to avoid. (Here $R_t$ is the rotation
# applied to the identity: `rope(eye, t)` is the matrix of $\operatorname{RoPE}_t$.)
#
# MLA's answer is the **decoupled** rotary key: position enters only through the extra $d_r$
# channels $q^{(h)}_{r,t}$ and $k^R_s$, computed from $x_s$ and not from $c_s$, rotated before
# they are cached; the $d_n$ channels that meet the latent carry no rotation, so $W_{UK}$ can be
# absorbed. That is the layer built above, whose absorbed and naive forms agreed to float64
# rounding (the first check of the absorption section). The price is $d_r$ more cached numbers
# per token (64 in DeepSeek-V3), and a rotary key shared by all heads.

# %% [markdown]
# ### DeepSeek's interleaved RoPE
#
# RoPE rotates pairs of channels. Llama, Qwen and `transformers`' `rotate_half` pair channel
# $i$ with $i + D/2$; DeepSeek's checkpoints pair neighbours, $2i$ with $2i + 1$ (their
# reference code rotates adjacent pairs as complex numbers). The two are the same rotation up to
# a fixed permutation of channels, evens first, then odds, and a score $q k^\top$ does not change
# when $q$ and $k$ are permuted alike. So a rotated tensor depends on the layout, a score does
# not. `tinyk3.layers.rope` keeps the input's layout; `transformers` (`rope_interleave=True`)
# returns DeepSeek's rotated $q, k$ **de-interleaved**, evens first:

# %%
gen = torch.Generator().manual_seed(1)
Dr = 8
q_r, k_r = (torch.randn(1, 2, 6, Dr, generator=gen, dtype=F64) for _ in range(2))
pos = torch.arange(10, 16)
evens_first = torch.cat([torch.arange(0, Dr, 2), torch.arange(1, Dr, 2)])
q_i, k_i = (rope(z, pos, interleaved=True) for z in (q_r, k_r))  # DeepSeek's layout
q_h, k_h = (rope(z[..., evens_first], pos) for z in (q_r, k_r))  # rotate-half
print(f"interleaved vs rotate-half of the permuted input: tensors "
      f"{max_diff(q_i, q_h):.2f} apart, after the permutation "
      f"{max_diff(q_i[..., evens_first], q_h):.1e}; scores "
      f"{max_diff(q_i @ k_i.mT, q_h @ k_h.mT):.1e}")
try:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds
except ImportError as err:
    hf_ds = None
    print(f"transformers' DeepSeek-V3 code is not importable here ({err}): skipped.")
if hf_ds is not None:
    freqs = pos.double()[:, None] / 10000.0 ** (torch.arange(0, Dr, 2).double() / Dr)
    emb = torch.cat([freqs, freqs], -1)[None]  # transformers' layout  [1, T, Dr]
    q_t, k_t = hf_ds.apply_rotary_pos_emb_interleave(q_r, k_r, emb.cos(), emb.sin())
    err = max_diff(q_i @ k_i.mT, q_t @ k_t.mT)
    DISTANCES["interleaved RoPE scores vs transformers'"] = err
    print(f"transformers' apply_rotary_pos_emb_interleave vs tinyk3's rope: tensors "
          f"{max_diff(q_t, q_i):.2f} apart, after the permutation "
          f"{max_diff(q_t, q_i[..., evens_first]):.1e}; scores {err:.1e}")

# %% [markdown]
# So a test of an interleaved layer against `transformers` compares scores, outputs or logits,
# never the rotated $q$ and $k$. Converting a checkpoint to rotate-half is the same
# permutation applied once to the output channels of the rotary parts of $W_{UQ}$ and $W_{KR}$.
#
# ### NoPE: Kimi Linear and Kimi K3
#
# Kimi Linear's and K3's MLA layers rotate nothing (no positional encoding, "NoPE"). They keep
# the layout, shared $d_r$ channels included: $k^R_t = x_t W_{KR}$ is simply not rotated, and
# the cache still holds $r + d_r$ numbers per token (`transformers`' `KimiLinearAttention` is
# DeepSeek-V3's layer without the rotation). What changes is the layer's view of order: without
# positions, attention sees its past as a set, and only the causal mask tells earlier from
# later. Shuffle the tokens before the last one and the last token's output does not move; with
# RoPE it does:

# %%
P_nope = {**P, "use_rope": False}  # the same weights, nothing rotated
order = torch.randperm(T - 1, generator=torch.Generator().manual_seed(2))
shuffled = torch.cat([x[:, order], x[:, -1:]], dim=1)  # the last token stays last
for name, P_ in (("NoPE", P_nope), ("RoPE", P)):
    last = mla(x, P_, attend=attend_absorbed)[0][:, -1]
    last_shuffled = mla(shuffled, P_, attend=attend_absorbed)[0][:, -1]
    print(f"{name}: last token's output, earlier tokens shuffled: max |Δy| "
          f"{max_diff(last, last_shuffled):.1e}")
y_full, _ = mla(x, P_nope)
y_pre, cache = mla(x[:, :5], P_nope, attend=attend_absorbed)
y_rest, cache = mla(x[:, 5:], P_nope, cache=cache, attend=attend_absorbed)
err = max_diff(torch.cat([y_pre, y_rest], 1), y_full)
DISTANCES["NoPE: absorbed latent-cache decoding vs full, float64"] = err
print(f"NoPE, absorbed, prefill 5 then decode 6 tokens, against the full naive "
      f"forward: max |Δy| {err:.1e}")

# %% [markdown]
# In Kimi Linear and K3 the order comes from the KDA layers between the MLA layers, whose state
# is built token by token (chapters 11 and 12). Those layers keep no growing cache, so only the
# MLA layers' cache grows with the context. (K3's MLA also multiplies the heads' outputs by a
# sigmoid gate of its input before $W_O$, `output_gate=True`; the cache is unchanged.) The
# presets count them:

# %%
for name, cfg in (("Kimi Linear 48B", presets.kimi_linear_48b()),
                  ("Kimi K3", presets.kimi_k3_mixers())):
    s_ = mla_spec(cfg)
    kinds = [m.kind for m in cfg.layer_mixers]
    n_cache = kinds.count("mla")
    print(f"{name}: MLA use_rope={s_.use_rope}, {s_.state_numel(1, 1)} values per "
          f"token and MLA layer; {n_cache} of {len(kinds)} layers keep a cache: "
          f"{1 - n_cache / len(kinds):.1%} less than MLA in every layer")

# %% [markdown]
# ## Check: the library layer against `transformers`' DeepSeek-V3 attention
#
# `tinyk3.layers.mla.MultiHeadLatentAttention` is this layer as the models of the next chapters
# use it, with `transformers`' parameter names (`q_a_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`,
# ...) and a `form` switch, `"expanded"` or `"absorbed"` (the layer's `absorb` reads and sets
# it as a bool). Both are checked against `DeepseekV3Attention`, built offline at
# a tiny random configuration with the low-rank query and interleaved RoPE, its norms' weights
# randomised, and its weights copied into ours; and the library layer once more with the other
# two options `transformers` has, a full-rank query projection and rotate-half RoPE. (The
# released DeepSeek-V3 and Kimi K2 stretch RoPE for long contexts with YaRN, which changes the
# rotation frequencies and the score scale; the presets and `from_hf` build plain RoPE, as the
# presets' docstrings say.)

# %%
def weights_from_hf(attn):
    """transformers' DeepseekV3Attention weights as this notebook's matrices."""
    cfg = attn.config
    r_, dr_ = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    W = {name: p.detach().T for name, p in attn.named_parameters() if p.dim() == 2}
    return dict(H=cfg.num_attention_heads, r=r_, dn=cfg.qk_nope_head_dim, dr=dr_,
                dv=cfg.v_head_dim, use_rope=True, W_DQ=W["q_a_proj.weight"],
                w_q=attn.q_a_layernorm.weight.detach(), W_UQ=W["q_b_proj.weight"],
                W_DKV=W["kv_a_proj_with_mqa.weight"][:, :r_],
                W_KR=W["kv_a_proj_with_mqa.weight"][:, r_:],
                w_kv=attn.kv_a_layernorm.weight.detach(), W_UKV=W["kv_b_proj.weight"],
                W_O=W["o_proj.weight"])


def hf_attention(q_lora_rank, rope_interleave, seed):
    """A tiny random DeepseekV3Attention (norm weights randomised) and its output on a
    random input with the causal mask; returns (layer, x, y)."""
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=64, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, rope_interleave=rope_interleave,
        attn_implementation="eager")
    torch.manual_seed(seed)
    attn = hf_ds.DeepseekV3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "layernorm" in name:
                p.add_(0.2 * torch.randn_like(p))
        xh = torch.randn(2, 9, cfg.hidden_size)
        T_h = xh.shape[1]
        mask = torch.full((T_h, T_h), -math.inf).triu(1)[None, None]  # eager needs one
        cos_sin = hf_ds.DeepseekV3RotaryEmbedding(cfg)(xh, torch.arange(T_h)[None])
        return attn, xh, attn(xh, cos_sin, mask)[0]


if hf_ds is None:
    print("transformers is not importable here: the oracle check is skipped.")
else:
    attn, xh, y_hf = hf_attention(q_lora_rank=24, rope_interleave=True, seed=3)
    with torch.no_grad():
        P_hf = weights_from_hf(attn)
        ours = MultiHeadLatentAttention.from_hf(attn)
        results = {"notebook's layer (naive)": mla(xh, P_hf)[0],
                   "notebook's layer (absorbed)": mla(xh, P_hf,
                                                      attend=attend_absorbed)[0],
                   "tinyk3 layer": ours(xh)[0]}
        ours.absorb = True
        results["tinyk3 layer, absorb=True"] = ours(xh)[0]
        # the other two options: a full-rank q_proj and rotate-half RoPE
        attn2, xh2, y_hf2 = hf_attention(q_lora_rank=None, rope_interleave=False,
                                         seed=4)
        ours2 = MultiHeadLatentAttention.from_hf(attn2)
        y_ours2 = {absorb: None for absorb in (False, True)}
        for absorb in y_ours2:
            ours2.absorb = absorb
            y_ours2[absorb] = ours2(xh2)[0]
    print("low-rank query, interleaved RoPE:")
    for name, y_ in results.items():
        DISTANCES[f"{name} vs transformers, float32"] = max_diff(y_, y_hf)
        print(f"{name:>28s} vs DeepseekV3Attention: max |Δy| {max_diff(y_, y_hf):.1e}")
    print("full-rank query, rotate-half RoPE:")
    for absorb, y_ in y_ours2.items():
        name = f"tinyk3 layer, absorb={absorb}"
        DISTANCES[f"{name}, q_proj, rotate-half, vs transformers"] = max_diff(y_, y_hf2)
        print(f"{name:>28s} vs DeepseekV3Attention: max |Δy| {max_diff(y_, y_hf2):.1e}")
    print(f"(float32; max |y| = {y_hf.abs().max():.2f} and {y_hf2.abs().max():.2f})")
    assert max(v for k, v in DISTANCES.items() if "transformers" in k) < 1e-5

# %% [markdown]
# Every form agrees with `transformers` to float32 rounding. The library layer also decodes
# from its latent state: prefilling part of the sequence, then feeding the rest in pieces,
# returns the outputs of one full forward, and its state holds $r + d_r$ numbers per token:

# %%
layer = MultiHeadLatentAttention(64, 4, kv_lora_rank=32, qk_nope_head_dim=16,
                                 qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=48,
                                 form="absorbed").double().eval()
x64 = torch.randn(2, 13, 64, dtype=F64)
with torch.no_grad():
    y_ref = layer(x64)[0]
    worst = 0.0
    for pieces in ((1, 12), (5, 1, 1, 6), (12, 1)):
        state, outs, start = None, [], 0
        for n in pieces:
            y_, state = layer(x64[:, start: start + n], state)
            outs.append(y_)
            start += n
        worst = max(worst, max_diff(torch.cat(outs, 1), y_ref))
DISTANCES["tinyk3 layer, decoding in pieces vs full, float64"] = worst
assert worst < 1e-12
print(f"pieces (1, 12), (5, 1, 1, 6), (12, 1): max |Δy| against the full forward "
      f"{worst:.1e}; state c {list(state.c.shape)}, k_rope {list(state.k_rope.shape)}")

# %% [markdown]
# ## Experiment 1: cache bytes against context
#
# How many bytes one sequence's cache takes as the context grows, for the attention layers of
# four models, each with four designs: MHA (every head's key and value), GQA, MQA and MLA. The
# model sizes come from the presets; for the designs a model does not use, the sizes follow by
# formula from its head counts and dimensions:
#
# - **MHA**: $H (D_k + D_v)$ per token and layer (for the MLA models, the keys and values their
#   heads attend with, $D_k = d_n + d_r$, $D_v = d_v$);
# - **GQA**: the same with 8 key-value heads, as Llama 3 has at all three of its sizes
#   (Llama Team, arXiv 2407.21783); for GPT-2, whose 12 heads 8 does not divide, 6;
# - **MQA**: one key-value head, $D_k + D_v$ (Shazeer, arXiv 1911.02150);
# - **MLA**: $r + d_r$, with DeepSeek-V2's rule $r = 4 D$, $d_r = D / 2$ for GPT-2's head width
#   $D = 64$, the released values for the others.
#
# Only layers that keep a cache count: all layers for GPT-2, DeepSeek-V3 and Kimi K2, the 24
# MLA layers for K3 (its 69 KDA layers keep a fixed-size state instead, chapter 12). bf16, two
# bytes per value.

# %%
def cache_values_per_token(cfg, design, kv_heads=8):
    """Values one token adds to the cache of all of a model's attention layers."""
    attn = [s for s in cfg.layer_mixers if s.kind in ("softmax", "mla")]
    s = attn[0]
    H = s.n_head
    if s.kind == "mla":
        Dk, Dv = s.qk_nope_head_dim + s.qk_rope_head_dim, s.v_head_dim
        r_, dr_ = s.kv_lora_rank, s.qk_rope_head_dim
    else:  # GPT-2: D = d_model / H; MLA by DeepSeek-V2's rule r = 4D, dr = D/2
        Dk = Dv = cfg.n_embd // H
        r_, dr_ = 4 * Dk, Dk // 2
    groups = max(g for g in range(1, kv_heads + 1) if H % g == 0)
    per_layer = {"MHA": H * (Dk + Dv), "GQA": groups * (Dk + Dv), "MQA": Dk + Dv,
                 "MLA": r_ + dr_}[design]
    return len(attn) * per_layer


MODELS = {"GPT-2 small": presets.gpt2_small(), "DeepSeek-V3": ds3,
          "Kimi K2": presets.kimi_k2(), "Kimi K3": presets.kimi_k3_mixers()}
RELEASED = {"GPT-2 small": "MHA", "DeepSeek-V3": "MLA", "Kimi K2": "MLA",
            "Kimi K3": "MLA"}
DESIGNS = ("MHA", "GQA", "MQA", "MLA")
BYTES = 2  # bf16
print(f"{'':>12s}" + "".join(f"{d_:>10s}" for d_ in DESIGNS)
      + "   bytes per token, bf16")
for name, cfg in MODELS.items():
    row = [cache_values_per_token(cfg, d_) * BYTES for d_ in DESIGNS]
    print(f"{name:>12s}" + "".join(f"{b:>10,}" for b in row)
          + f"   MHA/MLA {row[0] / row[3]:.0f}x, GQA/MLA {row[1] / row[3]:.1f}x, "
          f"MQA/MLA {row[2] / row[3]:.2f}x")
print("at each model's released context, one sequence:")
for name, cfg in MODELS.items():
    T_ = cfg.block_size
    gb = {d_: cache_values_per_token(cfg, d_) * BYTES * T_ / 1e9 for d_ in DESIGNS}
    print(f"{name:>12s}  {T_:>9,} tokens: "
          + ", ".join(f"{d_} {gb[d_]:,.2f} GB" for d_ in DESIGNS))

# %% mystnb={"figure": {"caption": "Bytes of one sequence's attention cache (bf16) against the context length for GPT-2 small, DeepSeek-V3, Kimi K2 and Kimi K3, each with multi-head attention (MHA), grouped-query attention with 8 key-value heads (GQA; 6 for GPT-2), multi-query attention with one (MQA, dotted) and multi-head latent attention (MLA). The design each model was released with is drawn thick, the dashed vertical line marks its released context, the dotted horizontal line 80 GB. For Kimi K3 only its 24 MLA layers keep a cache.", "name": "fig-mla-cache-bytes"}, "image": {"alt": "Four log-log panels, one per model, of cache gigabytes against context length from 1K to 1M tokens. Every line is straight with slope one, MHA highest, GQA below it, MLA below GQA, and MQA lowest, at about half of MLA. For GPT-2, drawn thick on MHA, the four lines lie within a factor of about twelve, all far below 80 GB at its context of 1K. For DeepSeek-V3 and Kimi K2, drawn thick on MLA, MHA lies about 71 and 36 times above MLA and crosses 80 GB well before their released contexts of 160K and 128K, where MLA needs about 10 GB. For Kimi K3, MLA in 24 layers stays near 30 GB at its context of 1M, below the 80 GB line, where MHA would pass a terabyte."}}
ctx = np.logspace(10, 20, 21, base=2)
fig, axes = plt.subplots(2, 2, figsize=(6.8, 5.2), sharex=True, sharey=True)
for ax, (name, cfg) in zip(axes.flat, MODELS.items()):
    for i, d_ in enumerate(DESIGNS):
        gb = cache_values_per_token(cfg, d_) * BYTES * ctx / 1e9
        ax.plot(ctx, gb, color=f"C{i}", lw=3 if d_ == RELEASED[name] else 1.2, label=d_,
                ls=":" if d_ == "MQA" else "-")
    ax.axhline(80, color="k", ls=":", lw=1)
    ax.axvline(cfg.block_size, color="gray", ls="--", lw=1)  # released context
    ax.set(xscale="log", yscale="log", title=name)
    ax.set_xticks([2**10, 2**14, 2**17, 2**20], ["1K", "16K", "128K", "1M"])
    ax.minorticks_off()
for ax in axes[1]:
    ax.set_xlabel("context (tokens)")
for ax in axes[:, 0]:
    ax.set_ylabel("cache, GB (bf16)")
axes[0, 0].legend(fontsize=8, loc="lower right")
axes[0, 0].text(2**11, 110, "80 GB", fontsize=7)
axes[0, 0].text(1100, 1e3, "released\ncontext", fontsize=7, color="gray")
plt.tight_layout()
plt.show()

# %% [markdown]
# The dotted line is 80 GB, the memory of one large GPU (an H100), the dashed one each model's
# released context. With per-head keys and values, one sequence of DeepSeek-V3's full context
# would need the memory of about ten such GPUs for its cache alone (the lines above the
# figure); with MLA it takes about a dozen gigabytes, a fraction of one. GQA with 8 key-value
# heads sits between, and MLA is several times below even that: counted in key-value heads,
# MLA caches as much as GQA with fewer than two,

# %%
kv_heads_equiv = latent / (Dk + spec.v_head_dim)
print(f"DeepSeek-V3: (r + dr) / (Dk + Dv) = {latent} / {Dk + spec.v_head_dim} = "
      f"{kv_heads_equiv:.2f} key-value heads; with heads of 128 for keys and "
      f"values, as DeepSeek-V2 counts: {latent / (2 * 128):.2f}")

# %% [markdown]
# (DeepSeek-V2's paper states the second number: MLA's cache equals GQA's with 2.25 groups.)
#
# **Why not MQA?** One key-value head shared by all query heads caches fewer bytes than MLA in
# every model of the table (the MQA/MLA column), so bytes are not why DeepSeek built MLA. The
# reason is quality. DeepSeek-V2's paper (arXiv 2405.04434, §2.1 and appendix D) ranks the
# capability of the designs as MHA strong, GQA moderate, MQA weak and MLA stronger than MHA, from
# ablations of dense and MoE models trained each way. The mechanism is visible in this chapter's
# equations: in training and prefill MLA *is* multi-head attention, each head with its own keys
# $c_s W_{UK}^{(h)\top}$ and values $c_s W_{UV}^{(h)}$ expanded from the latent; only decoding
# reads the latent as one shared head, through absorption, and there each head still sees the
# cache through its own $W_{UK}^{(h)}$ and $W_{UV}^{(h)}$. MQA shares one key and one value
# among all heads in training too. MLA pays in arithmetic at each decoding step (the next
# sections) and in rank: every head's keys lie in the same $r$-dimensional space.
# Kimi K3 keeps its cache in about a quarter of its layers and so caches the fewest bytes per
# token of the three large models; its KDA layers keep a state that does not grow with the
# context (chapter 12).

# %% [markdown]
# ## Experiment 2: absorbed decoding against an expanded cache, measured
#
# One decoding step of one layer's attention (the query is given; the projections common to
# both forms are left out), from a latent cache of $T$ tokens, at DeepSeek-V3's head sizes
# ($r = 512$, $d_n = 128$, $d_r = 64$, $d_v = 128$) with fewer heads, float32, one thread:
# the naive form expands the whole cache at every step, the absorbed one does not; and, for
# reference, MHA reading keys and values already expanded and cached per head (71 times the
# bytes at DeepSeek-V3's head count). Each time is the median of 5 runs (`tinyk3.timing`;
# fewer once a form's runs add up to 5 s).

# %%
PT = init_mla(d=64, H=TIME_HEADS, r=512, dn=128, dr=64, dv=128, rq=64, seed=4,
              dtype=F32)
W_UK_t, W_UV_t = up_projections(PT)


def attend_expanded(q_nope, q_rope, k, v):
    """MHA from a cache of per-head keys and values."""
    q = torch.cat([q_nope, q_rope], dim=-1)
    return causal_softmax(q @ k.mT / math.sqrt(q.shape[-1])) @ v


times = {"naive (expand the latents)": [], "absorbed": [], "expanded K, V cache": []}
gen = torch.Generator().manual_seed(5)
with torch.no_grad():
    for T_ in CONTEXTS:
        c_t = torch.randn(1, T_, 512, generator=gen)
        k_rope_t = torch.randn(1, T_, 64, generator=gen)
        q_n = torch.randn(1, TIME_HEADS, 1, 128, generator=gen)
        q_r = torch.randn(1, TIME_HEADS, 1, 64, generator=gen)
        k_full = torch.cat([torch.einsum("bsr,hnr->bhsn", c_t, W_UK_t),
                            k_rope_t[:, None].expand(-1, TIME_HEADS, -1, -1)], -1)
        v_full = torch.einsum("bsr,hrv->bhsv", c_t, W_UV_t)
        o_n = attend_naive(q_n, q_r, c_t, k_rope_t, PT)
        o_a = attend_absorbed(q_n, q_r, c_t, k_rope_t, PT)
        assert max_diff(o_n, o_a) < 1e-4  # the same attention, timed three ways
        runs = {  # partial binds this context's tensors (a lambda would see the last)
            "naive (expand the latents)": partial(attend_naive, q_n, q_r, c_t, k_rope_t,
                                                  PT),
            "absorbed": partial(attend_absorbed, q_n, q_r, c_t, k_rope_t, PT),
            "expanded K, V cache": partial(attend_expanded, q_n, q_r, k_full, v_full)}
        for name, fn in runs.items():
            times[name].append(time_fn(fn, repeats=5, warmup=1, max_seconds=5.0))
print(bench.stamp())
NAMES = {"naive (expand the latents)": "naive", "absorbed": "absorbed",
         "expanded K, V cache": "expanded"}
print(f"{'T':>7s}" + "".join(f"{NAMES[n]:>26s}" for n in times)
      + "   naive/absorbed  expanded/absorbed")
for i, T_ in enumerate(CONTEXTS):
    tn, ta, te = (times[n][i] for n in times)
    cells = [f"{t_.ms(2)} ms" for t_ in (tn, ta, te)]
    ratios = [f"{a_ / ta:.2g}x" + ("" if distinguishable(a_, ta) else " (~)")
              for a_ in (tn, te)]
    print(f"{T_:>7,}" + "".join(f"{c_:>26s}" for c_ in cells)
          + f"{ratios[0]:>17s}{ratios[1]:>19s}")
print("(~): within the spread, the quartile ranges overlap")
T_ = CONTEXTS[-1]
bytes_read = {"latent cache": T_ * (512 + 64) * 4,
              "expanded cache": T_ * TIME_HEADS * (128 + 64 + 128) * 4}
mb = {k: v / 1e6 for k, v in bytes_read.items()}
print(f"at T = {T_:,}: the absorbed step reads {mb['latent cache']:.0f} MB of cache; "
      f"the expanded one reads {mb['expanded cache']:.0f} MB "
      f"({mb['expanded cache'] / mb['latent cache']:.1f}x) and does "
      f"{(2 * 512 + 64) / (128 + 64 + 128):.1f}x fewer flops")

# %% mystnb={"figure": {"caption": "Time of one decoding step of one MLA layer's attention on one CPU thread against the length of the cached context (float32, DeepSeek-V3's head sizes, fewer heads): expanding the latents at every step (naive), weight absorption, and multi-head attention reading a cache of already expanded keys and values. Bars show the first to third quartile of the runs.", "name": "fig-mla-decode-time"}, "image": {"alt": "Log-log plot of milliseconds per decoding step against the cached context from 256 to 16,384 tokens. All three end far higher at the longest context than at the shortest. The naive line lies highest, many times above the other two at every length. The line for the expanded cache starts below the absorbed one at the shortest context and ends above it at the longest."}}
fig, ax = plt.subplots(figsize=(6.4, 3.8))
for i, (name, ts) in enumerate(times.items()):
    med = np.array([float(t_) for t_ in ts]) * 1e3
    low = med - np.array([t_.low for t_ in ts]) * 1e3
    high = np.array([t_.high for t_ in ts]) * 1e3 - med
    ax.errorbar(CONTEXTS, med, yerr=[low, high], marker="o", ms=4, capsize=3,
                color=f"C{i}", label=name)
ax.set(xscale="log", yscale="log", xlabel="cached context T (tokens)",
       ylabel="ms per decoding step", title=f"One MLA layer, {TIME_HEADS} heads, CPU")
ax.set_xticks(CONTEXTS, [f"{T_:,}" for T_ in CONTEXTS])
ax.minorticks_off()
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Between the absorbed step and MHA from an expanded cache the measurement shows a trade, not a
# free win: the absorbed step does more arithmetic per cached token (the multiple
# in the last printed line) and reads fewer bytes (its cache is $r + d_r$ wide where the
# expanded one is $H(D_k + D_v)$). Which of the two is faster on a CPU depends on whether the
# step waits on arithmetic or on memory, and the last column shows how that changes with the
# length here: a decoding step is a matrix-vector product, each cached number used by $H$
# heads at most, so once the cache outgrows the CPU's caches even a CPU starts to wait on
# memory. The naive step is the slowest at every length, by the factor in the naive/absorbed
# column: its time goes into expanding the cache, the flops counted in the absorption section.
#
# What this cannot show is the regime MLA is built for. Here one sequence runs on one thread,
# with far fewer heads than DeepSeek-V3's 128, so the expanded cache is only a few times the
# latent's size (the last line) where at full size it is 71 times (the first cell), and a
# CPU's memory bus is not a GPU's. On a GPU serving
# many sequences a decoding step is bound by the bytes it reads, and the cache's size decides
# how many sequences fit beside the weights at all (Experiment 1). A GPU measurement at batch
# and context sizes that fill its memory would be the test of that.

# %% [markdown]
# ## A published checkpoint (optional, in Colab)
#
# In Colab the cell below downloads a checkpoint in DeepSeek-V3's published format
# (`transformers`' own tiny test model of the architecture: MLA layers like this chapter's, with
# random weights, so the generated text is noise; the trained DeepSeek-V3 needs over 600 GB),
# loads it with `tinyk3.models.from_hf`, compares the logits with `transformers`' and generates
# through the latent cache. Anywhere else it says why it is skipped.

# %%
from tinyk3.models import try_checkpoint
from tinyk3.models.demo import CHECKPOINTS

demo = try_checkpoint(CHECKPOINTS["deepseek_v3"])

# %% [markdown]
# **What the cell shows in Colab** (this website is built offline, so it shows the skip
# message): three lines, the checkpoint's name with its parameter count and `model_type`; the
# largest logit difference between `tinyk3` and `transformers` on the same input, at float32
# rounding when the loader is right; and a greedy continuation of a short prompt, which is
# noise because the weights are random. The same check runs offline in the course's tests, on
# models written in the checkpoint's format.

# %% [markdown]
# ## Exercises
#
# ```{exercise} The absorbed scores
# :label: ex-mla-absorbed-scores
#
# Write `absorbed_scores(q_nope, q_rope, c, k_rope, w_uk)`: the scores of MLA before the mask
# and the softmax, computed from the latent cache without expanding it,
# $s_{ts} = (q_{n,t} W_{UK} c_s^\top + q_{r,t} k^{R\top}_s) / \sqrt{d_n + d_r}$ for every head.
# Inputs `q_nope [B, H, T, dn]`, `q_rope [B, H, T, dr]`, `c [B, S, r]`, `k_rope [B, S, dr]` (one
# rotary key for all heads) and `w_uk [H, dn, r]` (as `up_projections` returns it); return
# `[B, H, T, S]`. `dr` may be 0 (no shared channels).
# ```

# %%
def absorbed_scores_mine(q_nope, q_rope, c, k_rope, w_uk):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("mla.absorbed_scores", absorbed_scores_mine)

# %% [markdown]
# ```{solution-start} ex-mla-absorbed-scores
# :class: dropdown
# ```

# %%
def absorbed_scores_solution(q_nope, q_rope, c, k_rope, w_uk):
    q_lat = q_nope @ w_uk  # q_nope W_UK per head                   [B, H, T, r]
    s = q_lat @ c.unsqueeze(1).mT  # against the latents, shared     [B, H, T, S]
    s = s + q_rope @ k_rope.unsqueeze(1).mT  # + the shared rotary key
    return s / math.sqrt(q_nope.shape[-1] + q_rope.shape[-1])


ok = checks.run("mla.absorbed_scores", absorbed_scores_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} Interleaved RoPE
# :label: ex-mla-interleaved-rope
#
# Write `interleaved_rope(x, positions, theta)`: RoPE in DeepSeek's layout. For `x [..., T, D]`
# and integer `positions [T]`, channels $2i$ and $2i + 1$ of token $t$ form a pair rotated by the
# angle $t\,\theta_i$ with $\theta_i = \text{theta}^{-2i/D}$:
# $y_{2i} = x_{2i}\cos - x_{2i+1}\sin$, $y_{2i+1} = x_{2i+1}\cos + x_{2i}\sin$. Return the
# result in the same interleaved layout and dtype (not de-interleaved, as `transformers` does).
# ```

# %%
def interleaved_rope_mine(x, positions, theta):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("mla.interleaved_rope", interleaved_rope_mine)

# %% [markdown]
# ```{solution-start} ex-mla-interleaved-rope
# :class: dropdown
# ```

# %%
def interleaved_rope_solution(x, positions, theta):
    D = x.shape[-1]
    freqs = theta ** (-torch.arange(0, D, 2, dtype=F64) / D)  # θ_i        [D/2]
    angles = positions.to(F64)[:, None] * freqs  # t θ_i                 [T, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # the pairs (2i, 2i + 1)
    y = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return y.flatten(-2)  # each pair back in its place


ok = checks.run("mla.interleaved_rope", interleaved_rope_solution)

# %% [markdown]
# `torch.cat((y1, y2), -1)` in place of the last two lines is `transformers`' layout: the checker
# says so. DeepSeek-V3's own inference code does the same with complex numbers,
# `torch.view_as_complex` on pairs times $e^{i t \theta_k}$.
#
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - Decoding reads the whole cache at every step; MHA caches $H(D_k + D_v)$ numbers per token and
#   layer, 40,960 at DeepSeek-V3's sizes. MLA caches a normalised latent $c_t = \operatorname{RMSNorm}(x_t
#   W_{DKV})$ of $r = 512$ and one shared rotary key of $d_r = 64$: 576, 71 times fewer (computed
#   from the preset above). The low-rank query path saves weights, not cache.
# - **Weight absorption**: $q_n k_n^\top = (q_n W_{UK}) c^\top$, and $\sum_s p_s c_s W_{UV} =
#   (\sum_s p_s c_s) W_{UV}$, so decoding never expands the latents: MLA decodes as multi-query
#   attention with a 576-wide key and a 512-wide value shared by all heads, the scale staying
#   $1/\sqrt{d_n + d_r}$. Naive and absorbed agree to float64 rounding, and decoding from the
#   latent cache equals the full forward at every split tried.
# - RoPE on keys expanded from the latent puts $R_{t-s} W_{UK}$, a matrix per distance, between
#   query and latent, so no single matrix can be absorbed: both one-matrix attempts were off by
#   the scores' own size. The decoupled rotary key, computed from $x$ and shared by the heads,
#   keeps absorption exact. DeepSeek's interleaved RoPE is rotate-half after a fixed channel
#   permutation: equal scores, different tensors (`transformers` returns them de-interleaved).
#   Kimi Linear and K3 rotate nothing (NoPE): the same 576 values per token, in about a quarter
#   of their layers, with order left to the causal mask and to the KDA layers.
# - `tinyk3.layers.mla.MultiHeadLatentAttention` equals `transformers`' `DeepseekV3Attention` to
#   float32 rounding, naive and absorbed, and decodes in pieces to the full forward.
# - For DeepSeek-V3, Kimi K2 and K3, MLA's cache is 36 to 71 times smaller than MHA's would be
#   and several times smaller than GQA's with 8 key-value heads (the table of Experiment 1).
#   One shared head (MQA) caches less still; DeepSeek chose MLA for quality, since it trains and
#   prefills as full multi-head attention.
# - Against a cache of expanded keys and values, absorbed decoding trades arithmetic for bytes:
#   about 3.4 times the flops per step, 71 times fewer bytes read at DeepSeek-V3's size. On one CPU
#   thread which wins depends on the length; the memory-bound regime that MLA is designed for
#   needs a GPU to measure. Re-expanding the latent cache at every step is many times slower
#   than both.
#
# The distances measured in this chapter:

# %%
for name, dist in DISTANCES.items():
    print(f"{name:>66s}: {dist:.1e}")

# %% [markdown]
# **Next.** Chapter 14 replaces the dense feed-forward layer with a mixture of experts, the
# other half of DeepSeek-V3's and Kimi's blocks.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
