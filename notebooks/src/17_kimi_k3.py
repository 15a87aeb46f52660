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
# # Kimi K3
#
# The destination of the course: Kimi K3 (Moonshot AI, weights released in July 2026), the
# model of the title, announced with 2.8 trillion parameters of which 104 billion are used for
# each token. Its token mixers are chapter 15's Kimi Linear hybrid (KDA in three of every four
# layers, position-free MLA in the fourth), its feed-forward layers chapter 14's mixture of
# experts. What is new sits between and inside them: the residual stream itself becomes an
# attention over depth, the experts run in a narrower latent space, a soft-capped gated unit
# replaces SiLU, and both mixers get sigmoid gates on their outputs.
#
# **Sources.** No technical report was available when this chapter was written. What it says
# about K3 comes from the released `config.json` (its `text_config`, as mirrored model cards
# and third-party readings give it) and from third-party ports that run the released weights,
# mlx-lm's `models/kimi_k3.py` above all; block attention residuals are described in Kimi
# Team, *Attention Residuals*, arXiv 2603.15031. Where a value was assumed rather than read,
# `tinyk3.models.presets.kimi_k3`'s docstring says so, and this chapter repeats it.
#
# **In this chapter** you build every change from Kimi Linear small, each checked against
# `tinyk3` with a printed distance (and against mlx-lm where it is installed): the layer
# pattern; block attention residuals, and what they do and do not reduce to; SiTU-GLU and its
# caps; the latent mixture of experts; MLA's sigmoid output gate; KDA's lower-bound gate and
# full-rank output gate. Then a tiny K3-shaped model whose cached decoding equals its full
# forward; the parameter counts of the released configuration and the title's ratio, three
# ways; the decoding memory at a million tokens; and a tiny K3 trained briefly against a
# GPT-2 of the same size.
#
# **Cost.** A few minutes on one CPU core, most of it in the training experiment (the last
# cell prints the time); `SMOKE = True` runs in seconds.


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
import copy
import dataclasses
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from tinyk3 import checks, data
from tinyk3.layers import (
    KDAConfig,
    KimiDeltaAttention,
    MLAConfig,
    MoEConfig,
    MultiHeadLatentAttention,
    SwiGLUConfig,
    moe,
)
from tinyk3.models import LM, LMConfig, count_parameters, presets
from tinyk3.models.gpt2 import gpt2_config
from tinyk3.models.lm import DepthMix
from tinyk3.train import train_lm
from tinyk3.util import max_diff

STEPS = 4 if SMOKE else 150  # training steps of the experiment, for each model
SEEDS = (0,) if SMOKE else (0, 1)  # one training run per model and seed
BATCH, CONTEXT = 16, 64  # sequences per step and tokens per sequence
RESULTS = {}  # distances for the closing note

try:  # the independent implementation, where installed (never required)
    import mlx.core as mx
    from mlx_lm.models import kimi_k3 as mlx_k3
except ImportError as err:
    mlx_k3 = None
    print(f"mlx-lm is not importable ({err}): the comparisons with it are skipped "
          "(pip install 'mlx[cpu]' and mlx-lm --no-deps to run them)")

# %% [markdown]
# ## From Kimi Linear to Kimi K3
#
# The two released configurations, side by side (`presets.kimi_linear_48b()` and
# `presets.kimi_k3()`, each citing its source):

# %%
K3, KL = presets.kimi_k3(), presets.kimi_linear_48b()


def describe(cfg):
    kda = next(m for m in cfg.layer_mixers if m.kind == "kda")
    mla = next(m for m in cfg.layer_mixers if m.kind == "mla")
    mo = next(m for m in cfg.layer_mlps if isinstance(m, MoEConfig))
    return {
        "layers (KDA + MLA)": f"{cfg.n_layer} ({cfg.kinds.count('kda')} + "
                              f"{cfg.kinds.count('mla')})",
        "width": f"{cfg.n_embd:,}",
        "KDA heads x dim": f"{kda.n_head} x {kda.head_dim}",
        "KDA gate / output gate": f"{kda.gate} / {kda.output_gate}",
        "MLA heads, output gate": f"{mla.n_head}, {mla.output_gate}",
        "experts (per token, shared)": f"{mo.n_experts} ({mo.top_k}, {mo.n_shared})",
        "expert hidden / latent": f"{mo.expert_hidden:,} / {mo.latent_dim or '-'}",
        "activation": mo.activation,
        "attention residual blocks": cfg.attn_res_block_size or "-",
    }


rows_k3, rows_kl = describe(K3), describe(KL)
print(f"{'':>28s}{'Kimi Linear 48B':>22s}{'Kimi K3':>22s}")
for key in rows_k3:
    print(f"{key:>28s}{str(rows_kl[key]):>22s}{str(rows_k3[key]):>22s}")

# %% [markdown]
# ## The layer pattern
#
# Like Kimi Linear's, K3's configuration lists its full-attention layers counted from 1
# (`linear_attn_config["full_attn_layers"]`): every fourth layer and the last. Python counts
# from 0, so layer $j$ of the list is list position $j - 1$:

# %%
lin = presets.KIMI_K3_TEXT_CONFIG["linear_attn_config"]
full_1based = lin["full_attn_layers"]
n_layer = presets.KIMI_K3_TEXT_CONFIG["num_hidden_layers"]
kinds_mine = ["mla" if i + 1 in full_1based else "kda" for i in range(n_layer)]
print(f"full_attn_layers (1-based): {full_1based[:3]} ... {full_1based[-3:]}")
mla_at = [i for i, k in enumerate(kinds_mine) if k == "mla"]
print(f"0-based MLA positions: {mla_at[:3]} ... {mla_at[-3:]} "
      "(the last two are neighbours)")
print(f"{kinds_mine.count('kda')} KDA and {kinds_mine.count('mla')} MLA layers; "
      f"equal to presets.kimi_k3().kinds: {tuple(kinds_mine) == K3.kinds}")
print(f"first layer: mixer {K3.kinds[0]}, feed-forward {K3.layer_mlps[0].kind} "
      f"(hidden {K3.layer_mlps[0].hidden:,}); the others: "
      f"{sorted({m.kind for m in K3.layer_mlps[1:]})}")

# %% [markdown]
# So the last full-attention layer follows another one directly (0-based 91 and 92): 93 is not
# a multiple of four, and the model ends on global attention anyway, as Kimi Linear's 27
# layers do.
#
# ## Block attention residuals
#
# **The idea.** In GPT-2 and every model since, layer $\ell$ reads the residual stream
# $x_\ell = h_0 + \sum_{j < \ell} f_j$, the embedding plus the sum of every earlier sub-layer's
# output, each with weight one. *Attention Residuals* replaces the fixed sum by a learned,
# input-dependent mixture over depth: each read is a softmax over earlier outputs, as
# attention is a softmax over earlier tokens. Attending to every earlier sub-layer would keep
# $2\ell$ vectors per token; the block form keeps a few. The layers are cut into blocks of
# $n$ (K3: $n = 12$); the sources of a read are the **completed block sums** $b_0 = h_0$
# (the embedding), $b_1, \dots, b_m$ (each the sum of one finished block's sub-layer outputs)
# and the **partial sum** $p$ of the current block so far.
#
# **The math.** With the sources $s_0, \dots, s_m, s_{m+1} = p$, each a $d$-vector for one
# token, a read with the learned vectors $w_{\text{norm}}, w_{\text{proj}} \in \mathbb{R}^d$ is
#
# $$
# \operatorname{read}(s_0, \dots, s_{m+1}) = \sum_{i=0}^{m+1} \pi_i\, s_i, \qquad
# \pi = \operatorname{softmax}_i\!\left(\frac{s_i}{\operatorname{rms}(s_i)} \cdot
#       (w_{\text{norm}} \odot w_{\text{proj}})\right), \qquad
# \operatorname{rms}(s) = \sqrt{\tfrac{1}{d} \textstyle\sum_c s_c^2 + \epsilon} .
# $$
#
# The keys are the RMS-normed sources (`RMSNorm` then a $d \to 1$ projection, so the two
# weights act as one vector), there is no $1/\sqrt{d}$, and the values are the **raw** sources:
# a block that wrote a large update contributes a large vector. The softmax runs over depth,
# separately for each token, so the read needs nothing from other tokens: decoding adds
# nothing to the cache. A block of layers then runs as follows (mlx-lm's
# `KimiK3DecoderLayer`, and `tinyk3.models.lm.Block`):
#
# 1. the attention input is $\operatorname{read}(b_0, \dots, b_m, p)$;
# 2. if the layer starts a block, $p$ becomes the completed $b_{m+1}$ and a new $p$ starts
#    empty (the layer at 0-based index $\ell$ starts a block when $\ell \bmod n = 0$, so layer 0
#    turns the embedding into $b_0$);
# 3. $p \leftarrow p + \operatorname{attn}(\operatorname{norm}(\text{input}))$;
# 4. the MLP input is a second read (its own weights) over the same blocks and the new $p$;
#    $p \leftarrow p + \operatorname{mlp}(\operatorname{norm}(\text{input}))$.
#
# After the last layer a final read (`output_attn_res`) gives the input of the final norm and
# the head. One read, from scratch, against `DepthMix`, the library's:

# %%
def depth_mix_mine(blocks, partial, w_norm, w_proj, eps, *, weights=False):
    """One read: a softmax over depth of the block sums and the partial sum."""
    if not blocks:
        return (partial, None) if weights else partial
    src = torch.stack([*blocks, partial])  # [S, B, T, d]
    keys = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps)  # RMS-normed
    logits = keys @ (w_norm * w_proj)  # [S, B, T]: one logit per source and token
    p = logits.softmax(dim=0)  # over depth
    out = (p.unsqueeze(-1) * src).sum(0)  # the RAW sources
    return (out, p) if weights else out


gen = torch.Generator().manual_seed(0)
d = 32
mix = DepthMix(d, 1e-5).double()
with torch.no_grad():  # DepthMix starts at zero (a uniform mix): make it non-trivial
    mix.proj.weight.copy_(3 * torch.randn(1, d, generator=gen, dtype=torch.float64)
                          / math.sqrt(d))
    mix.norm.weight.copy_(1 + 0.2 * torch.randn(d, generator=gen, dtype=torch.float64))
srcs = [(i + 1) * torch.randn(2, 5, d, generator=gen, dtype=torch.float64)
        for i in range(4)]
with torch.no_grad():
    ours = depth_mix_mine(srcs[:3], srcs[3], mix.norm.weight, mix.proj.weight[0],
                          mix.norm.eps)
    dist = max_diff(ours, mix(srcs[:3], srcs[3]))
RESULTS["one read vs DepthMix (float64)"] = dist
print(f"my read against DepthMix: max |diff| {dist:.1e}")
if mlx_k3 is not None:
    blocks_mx = mlx_k3.ResidualBlocks(1e-5)
    for s in srcs[:3]:
        blocks_mx.append(mx.array(s.float().numpy()))
    w_eff = mx.array((mix.norm.weight * mix.proj.weight[0]).float().detach().numpy())
    theirs = mlx_k3._attn_res_mix(blocks_mx, mx.array(srcs[3].float().numpy()), w_eff,
                                  1e-5, False)
    dist = max_diff(ours, torch.tensor(theirs.tolist()))
    RESULTS["one read vs mlx-lm (float32)"] = dist
    print(f"my read against mlx-lm's _attn_res_mix (float32): max |diff| {dist:.1e}")

# %% [markdown]
# Now the residual stream of a whole model, from scratch, around the library's own sub-layers:
# a tiny K3-shaped model (four KDA layers and one MLA layer, attention residuals in blocks of
# two, a dense first layer, then the latent mixture of experts with SiTU-GLU; the pieces are
# built one by one in the sections below):

# %%
def tiny_k3(d=64, block=2, n_kda=4, eps=1e-5, vocab=256):
    """A K3-shaped LMConfig: n_kda KDA layers and one MLA layer, the second to last."""
    kda = KDAConfig(n_head=2, head_dim=d // 2, gate="lower_bound", output_gate="full",
                    chunk_size=16, norm_eps=eps)
    mla = MLAConfig(n_head=2, kv_lora_rank=d // 2, qk_nope_head_dim=d // 2,
                    qk_rope_head_dim=0, v_head_dim=d // 2, q_lora_rank=d // 2,
                    use_rope=False, output_gate=True, norm_eps=eps)
    pattern = [kda] * (n_kda - 1) + [mla] + [kda]
    lmoe = MoEConfig(8, 2, d, n_shared=1, activation="situ", latent_dim=d // 2,
                     latent_norm=True, norm_eps=eps)
    mlps = [SwiGLUConfig(2 * d, activation="situ")] + [lmoe] * (len(pattern) - 1)
    return LMConfig(vocab_size=vocab, block_size=4096, n_embd=d, pattern=tuple(pattern),
                    mlp=tuple(mlps), pos_emb=False, norm="rmsnorm", layer_norm_eps=eps,
                    tie_embeddings=False, attn_res_block_size=block)


def randomise_depth_mixes(model, gain=3.0, seed=0):
    """Random read vectors (the library starts them at zero: a uniform mix)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, DepthMix):
                d_ = m.proj.weight.shape[1]
                m.proj.weight.copy_(gain * torch.randn(m.proj.weight.shape, generator=g,
                                                       dtype=m.proj.weight.dtype)
                                    / math.sqrt(d_))


def randomise_small(model, seed=1):
    """Read vectors ~ N(0, 0.02²), the size of every other weight at initialisation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, DepthMix):
                m.proj.weight.copy_(0.02 * torch.randn(m.proj.weight.shape, generator=g,
                                                       dtype=m.proj.weight.dtype))


def zero_depth_mixes(model):
    """Zero read vectors: every read a uniform mix over its sources."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, DepthMix):
                m.proj.weight.zero_()


def stream_mine(model, idx):
    """The forward pass of an LM with attention residuals, written out."""
    tr = model.transformer

    def read(m, blocks, partial):
        w_norm, w_proj = m.norm.weight, m.proj.weight[0]
        return depth_mix_mine(blocks, partial, w_norm, w_proj, m.norm.eps)

    blocks, partial = [], tr.wte(idx)  # the embedding is the first partial sum
    for ell, layer in enumerate(tr.h):
        h = read(layer.self_attention_res, blocks, partial)
        if ell % model.config.attn_res_block_size == 0:  # a new block starts here
            blocks, partial = blocks + [partial], None
        y, _ = layer.attn(layer.ln_1(h))
        partial = y if partial is None else partial + y
        h = read(layer.mlp_res, blocks, partial)
        partial = partial + layer.mlp(layer.ln_2(h))
    x = read(tr.output_attn_res, blocks, partial)  # the final read
    return model.lm_head(tr.ln_f(x))


torch.manual_seed(0)
model = LM(tiny_k3()).double().eval()
randomise_depth_mixes(model)
idx = torch.randint(0, 256, (2, 24), generator=gen)
with torch.no_grad():
    dist = max_diff(stream_mine(model, idx), model(idx))
RESULTS["residual stream vs LM (float64)"] = dist
cfg = model.config
print(f"{cfg.n_layer} layers, blocks of {cfg.attn_res_block_size}: my stream against "
      f"LM: max |diff| of the logits {dist:.1e}")

# %% [markdown]
# **What it reduces to.** Two claims are often made: that a block per layer is "full"
# attention residuals, and that it reduces to the plain residual stream. The first holds by
# construction: with $n = 1$ every layer starts a block, so every earlier layer's output is a
# source of its own, and the read mixes all of them. The weights of the last layer's
# attention read, at random read vectors (sources: the embedding, then each layer's
# output):

# %%
def read_weights(model, idx, layer):
    """The depth weights of `layer`'s attention read, averaged over the tokens."""
    tr, out = model.transformer, {}
    hook = tr.h[layer].self_attention_res.register_forward_hook(
        lambda m, args, y: out.update(args=(list(args[0]), args[1])))
    with torch.no_grad():
        model(idx)
    hook.remove()
    blocks, partial = out["args"]
    m = tr.h[layer].self_attention_res
    _, p = depth_mix_mine(blocks, partial, m.norm.weight, m.proj.weight[0], m.norm.eps,
                          weights=True)
    return p.mean(dim=(1, 2))


full = LM(tiny_k3(block=1)).double().eval()
randomise_depth_mixes(full, seed=1)
p_last = read_weights(full, idx, full.config.n_layer - 1)
print(f"block size 1, last layer's read over {len(p_last)} sources: "
      + ", ".join(f"{v:.2f}" for v in p_last.tolist()))

# %% [markdown]
# The second claim does not hold in that form: a read is a convex combination, its weights sum
# to one, so it never equals the plain sum $h_0 + \sum_j f_j$ (whose weights are all one). What
# does hold is narrower, and worth knowing: (a) *inside* a block the partial sum is the plain
# sum of the block's outputs; (b) when all depth logits are equal (zero read vectors: how
# `LM` starts them), a read over $S$ sources is the plain
# residual sum divided by $S$, and since every read is followed by an RMSNorm (`ln_1`, `ln_2`,
# `ln_f`), which removes a positive scale up to its $\epsilon$, the model then computes what
# the plain-residual model with the same weights computes, at any block size. Checked on the
# logits, with the same weights loaded into a model without attention residuals (its "twin"),
# for zero read vectors (`LM`'s initialisation), for small random ones (entries of 0.02, the
# size of every other linear map's at initialisation) and for large random ones:

# %%
def plain_twin(model):
    """The same weights in a model with the plain residual stream."""
    cfg = dataclasses.replace(model.config, attn_res_block_size=0)
    twin = LM(cfg).to(model.transformer.wte.weight.dtype).eval()
    twin.load_state_dict(model.state_dict(), strict=False)  # without the read vectors
    return twin


READS = {"zero read vectors": zero_depth_mixes,
         "small read vectors": randomise_small,  # N(0, 0.02²) entries
         "random read vectors": randomise_depth_mixes}
print(f"{'logits, max |diff| from the twin':>44s}{'eps 1e-12':>11s}{'eps 1e-5':>11s}")
for block in (1, 2, 12):
    for what, set_reads in READS.items():
        row = []
        for eps in (1e-12, 1e-5):
            torch.manual_seed(0)
            m = LM(tiny_k3(block=block, eps=eps)).double().eval()
            set_reads(m)
            with torch.no_grad():
                row.append(max_diff(m(idx), plain_twin(m)(idx)))
        cols = "".join(f"{v:11.1e}" for v in row)
        print(f"block size {block:2d}, {what:>20s}:{cols}")
        RESULTS[f"vs plain twin, block {block}, {what}, eps 1e-12"] = row[0]

# %% [markdown]
# With zero read vectors the two models agree as far as the norms' $\epsilon$ allows: to about
# $10^{-9}$ at $\epsilon = 10^{-12}$, and visibly not at the released $\epsilon = 10^{-5}$
# (dividing the sum by $S$ makes $\epsilon$ count $S^2$ times more, against a residual stream
# that is small at initialisation: the embedding's entries are of order 0.02). With any other
# read vectors they differ at every block size, one layer per block included, by a sizeable
# fraction of the logits or more: even small read vectors (entries of 0.02) make the depth
# weights unequal, and the mixture
# of experts' discrete top-$k$ turns small changes of its input into different experts (the
# lines above). So attention residuals can *start* as the plain residual stream, if their
# read vectors start at zero, and learn away from it; they do not reduce to it.
#
# At K3's size: 93 layers in blocks of 12 start a block at 0-based layers 0, 12, …, 84, so the
# final read mixes the embedding, seven completed block sums and the partial sum of the last
# nine layers. Each token's reads keep at most that many $d$-vectors alive during the forward
# pass:

# %%
starts = [ell for ell in range(K3.n_layer) if ell % K3.attn_res_block_size == 0]
n_sources = len(starts) + 1  # blocks appended at each start, plus the partial sum
print(f"block starts (0-based): {starts}")
print(f"the final read has {n_sources} sources: the embedding, {len(starts) - 1} block "
      f"sums, the partial sum of {K3.n_layer - starts[-1]} layers")
n_reads = 2 * K3.n_layer + 1
print(f"{n_reads} reads, {2 * K3.n_embd * n_reads:,} parameters in all "
      f"(w_norm and w_proj, {K3.n_embd:,} each)")

# %% [markdown]
# ## SiTU-GLU
#
# Every feed-forward network of K3, the dense first layer, the shared and the routed experts,
# is a gated unit $W_{\text{down}}\,\phi(x W_{\text{gate}}^\top, x W_{\text{up}}^\top)$ as in
# chapter 14, with SiLU-GLU's $\phi(g, u) = g\,\sigma(g)\, u$ replaced by
#
# $$
# \phi_{\text{SiTU}}(g, u) = \underbrace{4 \tanh(g/4)\, \sigma(g)}_{\text{gate}} \cdot
#     \underbrace{25 \tanh(u/25)}_{\text{value}} ,
# $$
#
# read from mlx-lm's `_situ` and the configuration's `activation_situ_beta = 4` and
# `activation_situ_linear_beta = 25`. A soft cap $\beta \tanh(x/\beta)$ is $x$ for
# $|x| \ll \beta$ and tends to $\pm\beta$ beyond it; here it caps the gate's argument at 4
# before the sigmoid weighs it, and the value at 25, so no product can exceed
# $4 \cdot 25 = 100$ in magnitude, however large the pre-activations grow. (Why K3 caps is
# not documented in a report we could read; a bounded activation keeps the products in a
# range that low-precision weights and activations can represent, and K3's weights are
# MXFP4, quantisation-aware trained.)

# %%
def situ_mine(g, u):
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)


g_in = 30 * torch.randn(1000, generator=gen, dtype=torch.float64)
u_in = 200 * torch.randn(1000, generator=gen, dtype=torch.float64)
dist = max_diff(situ_mine(g_in, u_in), moe.situ(g_in, u_in))
RESULTS["SiTU-GLU vs moe.situ (float64)"] = dist
print(f"my SiTU-GLU against moe.situ: max |diff| {dist:.1e}")
if mlx_k3 is not None:
    u_mx, g_mx = mx.array(u_in.float().numpy()), mx.array(g_in.float().numpy())
    theirs = mlx_k3._situ(u_mx, g_mx, 4.0, 25.0)  # mlx-lm's order: value, gate
    dist = max_diff(situ_mine(g_in, u_in), torch.tensor(theirs.tolist()))
    RESULTS["SiTU-GLU vs mlx-lm (float32)"] = dist
    print(f"my SiTU-GLU against mlx-lm's _situ (float32): max |diff| {dist:.1e}")
print(f"largest |SiTU| on these inputs: {situ_mine(g_in, u_in).abs().max():.2f} "
      f"(bound 100); largest |SiLU-GLU|: {(F.silu(g_in) * u_in).abs().max():,.0f}")
small = torch.linspace(-1, 1, 201, dtype=torch.float64)
print(f"for |g|, |u| <= 1: max |SiTU - SiLU-GLU| "
      f"{max_diff(situ_mine(small, small), F.silu(small) * small):.3f}")

# %% mystnb={"figure": {"caption": "SiTU-GLU against SiLU-GLU. Left: the gate factor, SiTU's 4\u00b7tanh(g/4)\u00b7\u03c3(g) against SiLU's g\u00b7\u03c3(g); they agree near zero and SiTU's levels off below 4. Right: the value factor, 25\u00b7tanh(u/25) against the identity; it levels off at \u00b125. The product of the two is bounded by 100 in magnitude.", "name": "fig-k3-situ"}, "image": {"alt": "Two line plots. Left, horizontal axis gate pre-activation from -12 to 12: the SiLU gate rises as a straight line for positive inputs, dipping slightly below zero near -1.3; the SiTU gate follows it up to about 2 and then flattens towards 4, with the same dip. Right, horizontal axis value pre-activation from -80 to 80: the identity is a straight diagonal line; the capped value follows it near zero and flattens towards plus and minus 25."}}
gs = torch.linspace(-12, 12, 400)
us = torch.linspace(-80, 80, 400)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6.7, 2.8), layout="constrained")
ax1.plot(gs, F.silu(gs), label="SiLU: g·σ(g)")
ax1.plot(gs, 4 * torch.tanh(gs / 4) * torch.sigmoid(gs), label="SiTU: 4·tanh(g/4)·σ(g)")
ax1.axhline(4, color="k", lw=0.6, ls=":")
ax1.set_xlabel("gate pre-activation g")
ax1.set_title("gate factor", fontsize=10)
ax1.legend(fontsize=8)
ax2.plot(us, us, label="u")
ax2.plot(us, 25 * torch.tanh(us / 25), label="25·tanh(u/25)")
for c in (25, -25):
    ax2.axhline(c, color="k", lw=0.6, ls=":")
ax2.set_xlabel("value pre-activation u")
ax2.set_title("value factor", fontsize=10)
ax2.legend(fontsize=8)
plt.show()

# %% [markdown]
# Near zero the two units agree to first order (the lines above), so a model initialised with
# small weights starts out as a SiLU-GLU model; the caps matter only for the outliers.
#
# ## The latent mixture of experts
#
# Chapter 14's layer runs every routed expert at the model's width $d$. K3 projects each token
# down to a latent of $d_L = 3{,}584$ (half of $d = 7{,}168$), runs the routed experts there,
# normalises their weighted sum and projects it back up; the router and the two shared experts
# see the token at full width:
#
# $$
# z_t = x_t W_{\downarrow}^\top, \qquad
# y_t = \operatorname{RMSNorm}\Big(\sum_{i \in \mathcal{E}_t} w_{t,i}\,
#       \operatorname{FFN}_i(z_t)\Big)\, W_{\uparrow}^\top
#       + \operatorname{FFN}^{(s)}(x_t), \qquad
# W_{\downarrow} \in \mathbb{R}^{d_L \times d},\; W_{\uparrow} \in \mathbb{R}^{d \times d_L} ,
# $$
#
# with the routing $(w_{t,i}, \mathcal{E}_t)$ of chapter 14 (sigmoid scores, a selection-only
# bias, one group, renormalised) and SiTU-GLU experts. Note where the norm sits: after the
# weighted sum, not on each expert. From the layer's weights, against `moe.MoE`:

# %%
def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def ffn(x, gate_up, down):
    """A SiTU-GLU expert: gate_up [2h, d_in], down [d_in, h]."""
    g, u = (x @ gate_up.T).chunk(2, dim=-1)
    return situ_mine(g, u) @ down.T


def latent_moe_mine(x, layer):
    flat = x.reshape(-1, x.shape[-1])  # [N, d]
    w, idx, _ = layer.router(flat)  # chapter 14's routing, at full width
    z = flat @ layer.routed_expert_down_proj.weight.T  # [N, d_L]
    y = torch.zeros_like(z)
    for e in range(layer.router.n_experts):
        token, slot = torch.where(idx == e)
        out = ffn(z[token], layer.experts.gate_up_proj[e], layer.experts.down_proj[e])
        y = y.index_add(0, token, out * w[token, slot, None])
    n = layer.routed_expert_norm
    y = rms_norm(y, n.weight, n.eps)  # the norm after the weighted sum
    y = y @ layer.routed_expert_up_proj.weight.T  # back to full width
    s = layer.shared_experts  # full width
    y = y + situ_mine(flat @ s.gate_proj.weight.T, flat @ s.up_proj.weight.T) \
        @ s.down_proj.weight.T
    return y.view(x.shape)


lmoe = moe.MoE(32, 8, 2, 24, n_shared=2, activation="situ", latent_dim=16,
               latent_norm=True).double()
with torch.no_grad():
    lmoe.router.e_score_correction_bias.copy_(0.1 * torch.randn(8, generator=gen))
x = torch.randn(2, 20, 32, generator=gen, dtype=torch.float64)
with torch.no_grad():
    dist = max_diff(latent_moe_mine(x, lmoe), lmoe(x))
RESULTS["latent MoE vs moe.MoE (float64)"] = dist
print(f"my latent MoE against moe.MoE: max |diff| {dist:.1e}")

# %% [markdown]
# What the latent buys, at K3's sizes: the routed experts' weights scale with the width they
# run at, so halving it halves the experts' parameters and their work per token, for the price
# of two $d \times d_L$ projections per layer (`MoEConfig.num_parameters`, the same layer at
# full width for comparison):

# %%
k3_moe = next(m for m in K3.layer_mlps if isinstance(m, MoEConfig))
wide = dataclasses.replace(k3_moe, latent_dim=0, latent_norm=False)
dK3 = K3.n_embd
for name, m in (("latent (released)", k3_moe), ("full width", wide)):
    print(f"{name:>18s}: {m.num_parameters(dK3) / 1e9:6.2f}B per layer, "
          f"{m.num_active_parameters(dK3) / 1e9:5.3f}B used per token")
print(f"latent projections: {2 * dK3 * k3_moe.latent_dim / 1e6:.1f}M per layer; "
      f"per layer the latent saves "
      f"{1 - k3_moe.num_parameters(dK3) / wide.num_parameters(dK3):.0%} of the weights")

# %% [markdown]
# ## MLA's sigmoid output gate
#
# K3's MLA layers are chapter 13's position-free MLA (no RoPE: the configuration's
# `mla_use_nope`) with one addition, a sigmoid gate on the concatenated heads before the
# output projection, computed from the layer's input (as Qwen3-Next's gated attention does):
# $y_t = \big(o_t \odot \sigma(x_t W_G^\top)\big) W_O^\top$, with
# $W_G \in \mathbb{R}^{H d_v \times d}$. From the layer's pieces:

# %%
mla = MultiHeadLatentAttention(32, 4, kv_lora_rank=16, qk_nope_head_dim=8,
                               qk_rope_head_dim=0, v_head_dim=8, q_lora_rank=16,
                               use_rope=False, output_gate=True).double()
x = torch.randn(2, 12, 32, generator=gen, dtype=torch.float64)
with torch.no_grad():
    q_nope, q_rope = mla.queries(x, 0)
    c, k_rope = mla.latents(x, 0)
    o = mla.attend(q_nope, q_rope, c, k_rope)  # [B, H, T, dv], chapter 13
    o = o.transpose(1, 2).reshape(2, 12, -1)  # heads side by side
    y_mine = (o * torch.sigmoid(x @ mla.g_proj.weight.T)) @ mla.o_proj.weight.T
    y_lib, _ = mla(x)
    ungated = o @ mla.o_proj.weight.T
dist = max_diff(y_mine, y_lib)
RESULTS["gated MLA vs MultiHeadLatentAttention (float64)"] = dist
print(f"my gated MLA against MultiHeadLatentAttention(output_gate=True): "
      f"max |diff| {dist:.1e}")
print(f"the gate changes the output by up to {max_diff(ungated, y_lib):.2f}")
print(f"cache per token and layer: {mla.state_numel(1, 1)} values (the gate adds none)")

# %% [markdown]
# The gate is computed from the current token only, so it adds nothing to the cache; it lets
# each head's output be switched off per token, which softmax attention cannot do by itself
# (its weights sum to one over the past).
#
# ## KDA's lower-bound gate and full-rank output gate
#
# Kimi Linear's KDA forgets with $g_t = -e^{A}\operatorname{softplus}(f_t + b)$, per channel:
# any $g_t < 0$ is possible. K3 bounds it (the configuration's `gate_lower_bound = -5`):
#
# $$
# g_t = -5\, \sigma\big(e^{A} (f_t + b)\big) \in (-5, 0), \qquad
# \alpha_t = e^{g_t} \in (e^{-5}, 1),
# $$
#
# with $f_t$ the same low-rank projection of $x_t$ and $A$ (`A_log`), $b$ (`dt_bias`) learned.
# A step can forget at most a factor $e^{5} \approx 148$, so over a sub-chunk of $s = 16$ tokens
# the cumulative decay $\gamma_i = e^{G_i}$ of chapter 11's chunked form stays above $e^{-80}$,
# representable in float32, where an unbounded gate needs care. Its output gate is full rank:
# $\sigma(x_t W_g^\top)$ with $W_g \in \mathbb{R}^{H D_v \times d}$ instead of Kimi Linear's
# rank-$D_k$ product of two matrices. From the layer's pieces:

# %%
kda_k3 = KimiDeltaAttention(32, 2, 16, gate="lower_bound", output_gate="full").double()
kda_kl = KimiDeltaAttention(32, 2, 16).double()  # Kimi Linear's: softplus, low rank
with torch.no_grad():
    for layer in (kda_k3, kda_kl):
        layer.A_log.copy_(torch.tensor([0.5, 1.5], dtype=torch.float64))
        layer.f_b_proj.weight.mul_(20)  # large gate inputs, to show the bound
    kda_kl.f_a_proj.weight.copy_(kda_k3.f_a_proj.weight)
    kda_kl.f_b_proj.weight.copy_(kda_k3.f_b_proj.weight)
    kda_kl.dt_bias.copy_(kda_k3.dt_bias)
    x = torch.randn(2, 40, 32, generator=gen, dtype=torch.float64)
    f = (x @ kda_k3.f_a_proj.weight.T @ kda_k3.f_b_proj.weight.T).view(2, 40, 2, 16)
    f = f.transpose(1, 2)  # [B, H, T, Dk]
    A = kda_k3.A_log.exp().view(2, 1, 1)
    g_mine = -5 * torch.sigmoid(A * (f + kda_k3.dt_bias.view(2, 1, 16)))
    g_lib, g_kl = kda_k3.log_decay(x), kda_kl.log_decay(x)
    u_mine = (x @ kda_k3.g_proj.weight.T).view(2, 40, 2, 16)
    dist_u = max_diff(u_mine, kda_k3.output_gate_logits(x))
dist = max_diff(g_mine, g_lib)
RESULTS["lower-bound gate vs KimiDeltaAttention (float64)"] = dist
print(f"my lower-bound gate against KimiDeltaAttention.log_decay: max |diff| "
      f"{dist:.1e}")
print(f"my full-rank output gate logits against output_gate_logits: {dist_u:.1e}")
print(f"g in [{g_lib.min():.2f}, {g_lib.max():.3f}]; Kimi Linear's softplus gate on "
      f"the same inputs reaches {g_kl.min():.1f}")
full_gate = KDAConfig(n_head=96, head_dim=128, gate="lower_bound", output_gate="full")
low_gate = dataclasses.replace(full_gate, output_gate="low_rank")
extra = full_gate.num_parameters(dK3) - low_gate.num_parameters(dK3)
n_kda = K3.kinds.count("kda")
print(f"at K3's size the full-rank output gate has {extra / 1e6:.1f}M more parameters "
      "per KDA layer")
print(f"than a rank-128 one: {n_kda * extra / 1e9:.2f}B over {n_kda} layers")

# %% [markdown]
# ## The whole model: decoding equals the full forward
#
# All of it in one model: `LM(tiny_k3())` from above (four KDA layers and one MLA layer,
# attention residuals in blocks of two, the latent MoE with SiTU-GLU, random read vectors).
# Fed in pieces through its cache, each KDA layer carries its state and each MLA layer its
# latent cache, while the attention residuals need no cache at all (they mix depth, within
# each token). The logits must equal those of the full forward:

# %%
def piecewise(model, idx, cuts):
    cache, outs, t = model.new_cache(), [], 0
    with torch.no_grad():
        for n in cuts:
            outs.append(model(idx[:, t:t + n], cache))
            t += n
    return torch.cat(outs, dim=1), cache


T_dec = idx.shape[1]
cuts_list = ([1] * T_dec, [5, 1, 10, 8])
for dtype in (torch.float64, torch.float32):
    m = copy.deepcopy(model).to(dtype)
    with torch.no_grad():
        ref = m(idx)
    dists = [max_diff(piecewise(m, idx, cuts)[0], ref) for cuts in cuts_list]
    RESULTS[f"decode vs prefill ({str(dtype)[6:]})"] = max(dists)
    print(f"{str(dtype)[6:]}: token by token {dists[0]:.1e}, in pieces {cuts_list[1]} "
          f"{dists[1]:.1e} (logits up to {ref.abs().max():.1f})")
_, cache = piecewise(model, idx, cuts_list[1])
print("states:", [type(s).__name__ for s in cache.layers])

# %% [markdown]
# In float64 the two orders of computation agree to round-off; in float32 to a few
# $10^{-6}$ (the lines above; the prefill runs KDA chunkwise and decoding step by step, so the
# sums are ordered differently). The same model is checked against mlx-lm's `kimi_k3` (loaded
# from one checkpoint in the published format, through `tinyk3.models.from_checkpoint`) in
# the course's tests, `tests/test_models_k3.py`, with logits within $10^{-4}$.
#
# ## Parameters: the released configuration against the announcement
#
# `count_parameters(presets.kimi_k3())`, against the announced 2.8T total and 104B active:

# %%
n_k3 = count_parameters(K3)
PUBLISHED = (2.8e12, 104e9)
print(f"Kimi K3: total {n_k3.total:,} ({n_k3.total / 1e12:.4f}T, "
      f"{n_k3.total / PUBLISHED[0] - 1:+.2%} against 2.8T)")
print(f"         active {n_k3.active:,} ({n_k3.active / 1e9:.1f}B, "
      f"{n_k3.active / PUBLISHED[1] - 1:+.2%} against 104B)")

# %% [markdown]
# Where they sit, component by component, from the per-layer configurations (the rest is the
# norms):

# %%
def breakdown_k3(cfg):
    d = cfg.n_embd
    keys = ("embedding", "output head", "KDA layers", "MLA layers", "routers",
            "routed experts", "latent projections + norm", "shared experts",
            "dense MLP", "depth reads")
    rows = {k: [0, 0] for k in keys}

    def add(key, total, active=None):
        rows[key][0] += total
        rows[key][1] += total if active is None else active

    add("embedding", cfg.vocab_size * d)
    add("output head", 0 if cfg.tie_embeddings else cfg.vocab_size * d)
    for mixer, mlp in zip(cfg.layer_mixers, cfg.layer_mlps):
        kind = "KDA layers" if mixer.kind == "kda" else "MLA layers"
        add(kind, mixer.num_parameters(d))
        if isinstance(mlp, MoEConfig):
            routed = mlp.n_experts * 3 * mlp.expert_hidden * mlp.latent_dim
            add("routers", mlp.n_experts * d)
            add("routed experts", routed, routed * mlp.top_k // mlp.n_experts)
            add("latent projections + norm", 2 * d * mlp.latent_dim + mlp.latent_dim)
            add("shared experts", 3 * d * mlp.shared_width)
        else:
            add("dense MLP", mlp.num_parameters(d))
    add("depth reads", 2 * d * (2 * cfg.n_layer + 1))
    total, active = count_parameters(cfg)
    rows["norms (the rest)"] = [total - sum(r[0] for r in rows.values()),
                                active - sum(r[1] for r in rows.values())]
    return rows


table = breakdown_k3(K3)
print(f"{'':>26s}{'total':>11s}{'share':>8s}{'active':>10s}")
for key, (t_, a_) in table.items():
    print(f"{key:>26s}{t_ / 1e9:10.3f}B{t_ / n_k3.total:8.2%}{a_ / 1e9:9.3f}B")
print(f"norms: {table['norms (the rest)'][0]:,} parameters")
routed_t, routed_a = table["routed experts"]
print(f"routed experts: {routed_t / n_k3.total:.1%} of all weights, "
      f"{routed_a / n_k3.active:.1%} of the active ones")

# %% [markdown]
# The routed experts hold almost all the weights but less than half of what a token uses
# (the last line); attention of both kinds, the embeddings and the shared experts make up most
# of the rest. The counts land within about one percent of the announcement (the percentages
# above): 2.8T and 104B are rounded headline figures, and the derived count rests on
# assumptions, named in the docstrings of `presets.kimi_k3` and `KDAConfig`: the MLA head
# dimensions (taken from Kimi Linear) and the rank of KDA's low-rank forget-gate projection
# (taken to be the head dimension). Multi-token-prediction layers, if the checkpoint has any,
# are not built, as in chapter 14.
#
# ## The title's number, three ways
#
# "GPT-2 to Kimi K3": how many GPT-2s is one K3? The ratio depends on which two counts are
# divided:

# %%
n_gpt2 = count_parameters(presets.gpt2_small()).total
ratios = {"2.8e12 / 124e6 (both as announced)": 2.8e12 / 124e6,
          f"2.8e12 / {n_gpt2:,} (GPT-2's exact count)": 2.8e12 / n_gpt2,
          f"{n_k3.total:,} / {n_gpt2:,} (both counted)": n_k3.total / n_gpt2}
for what, r in ratios.items():
    print(f"{r:10,.1f}  {what}")
r = list(ratios.values())
print(f"differences: {r[0] - r[1]:.1f} from GPT-2's exact count, {r[1] - r[2]:.1f} "
      "more from K3's")

# %% [markdown]
# The first divides two rounded headline figures; the second replaces "124M" by GPT-2 small's
# exact 124,439,808 parameters (tied head counted once; `presets.gpt2_small()`), which is
# larger than 124M and lowers the ratio; the third also replaces "2.8T" by the count of the
# released configuration, which is below 2.8T and lowers it further (the differences printed
# above). All
# three say the same thing, some twenty-two thousand GPT-2s; the last one is the one a cell can
# reproduce from the configurations, and it inherits the assumptions named above.
#
# ## Memory at a million tokens
#
# What decoding holds per sequence at K3's context of $2^{20}$ tokens, from the preset's
# layers: each MLA layer caches one latent of $r + d_R$ values per token (chapter 13; K3's MLA
# has no RoPE but keeps the configuration's 64 shared key channels), each KDA layer a fixed
# state per head and its short convolutions' last inputs (chapter 12). Assuming bf16 for the
# caches and float32 for the states:

# %%
L_CTX = K3.block_size
mla_values = sum(m.state_numel(1, L_CTX) for m in K3.layer_mixers if m.kind == "mla")
kda_values = sum(m.state_numel(1, L_CTX) for m in K3.layer_mixers if m.kind == "kda")
mla_bytes, kda_bytes = 2 * mla_values, 4 * kda_values
print(f"context {L_CTX:,} tokens, one sequence:")
n_mla, n_kda = K3.kinds.count("mla"), K3.kinds.count("kda")
print(f"  MLA caches ({n_mla} layers): {mla_bytes / 1e9:.1f} GB in bf16")
print(f"  KDA states ({n_kda} layers): {kda_bytes / 1e6:.0f} MB in float32")
all_mla = 2 * K3.n_layer * mla_values / n_mla
print(f"an all-MLA K3 would cache {all_mla / 1e9:.1f} GB; the hybrid holds "
      f"{(mla_bytes + kda_bytes) / all_mla:.1%} of that")

# %% [markdown]
# ## Experiment: a tiny K3 against a GPT-2 of the same size
#
# Does the K3 recipe work at a size that trains on a laptop? The tiny K3-shaped model of this
# chapter, trained from scratch on the course's offline corpus (Python's own documentation,
# bytes as tokens: `tinyk3.data`), against a GPT-2 (softmax attention, learned positions,
# GELU MLP, tied head; `gpt2_config`) with about the same total parameter count, under the
# same budget: the same steps, batch, context, learning-rate schedule and seed
# (`tinyk3.train.train_lm`). Two seeds per model, and a small budget: a first look, not a
# ranking.

# %%
corpus = data.encode(data.load_corpus())
train_data, val_data = data.split(corpus)


def build(name, seed):
    torch.manual_seed(seed)
    if name == "tiny K3":
        return LM(tiny_k3(d=64, block=2))
    return LM(gpt2_config(vocab_size=256, block_size=CONTEXT, n_layer=4, n_head=4,
                          n_embd=92))


NAMES = ("tiny K3", "GPT-2")
for name in NAMES:
    n = count_parameters(build(name, 0).config)
    print(f"{name:>8s}: {n.total:,} parameters ({n.active:,} active)")
runs = {}
for seed in SEEDS:
    for name in NAMES:
        r = train_lm(build(name, seed), train_data, val_data, steps=STEPS,
                     batch_size=BATCH, block_size=CONTEXT, lr=3e-3,
                     warmup=min(20, STEPS // 4), eval_every=max(1, STEPS // 6),
                     seed=seed, progress=False)
        runs[name, seed] = r
        print(f"{name:>8s}, seed {seed}: validation loss {r.val_loss[0]:.3f} -> "
              f"{r.val_loss[-1]:.3f} (nats per byte) in {r.seconds:.0f} s")
gaps = [runs["GPT-2", s].val_loss[-1] - runs["tiny K3", s].val_loss[-1] for s in SEEDS]
secs = {n: sum(runs[n, s].seconds for s in SEEDS) for n in NAMES}
print("final validation loss, GPT-2 minus tiny K3, per seed: "
      + ", ".join(f"{g:+.3f}" for g in gaps))
print(f"time per step, tiny K3 over GPT-2: {secs['tiny K3'] / secs['GPT-2']:.1f}x")

# %% mystnb={"figure": {"caption": "Validation loss (nats per byte, on fixed windows of held-out text) against training steps, for the tiny K3-shaped model and a GPT-2 of about the same total parameter count, trained with the same steps, batch, context, learning-rate schedule and seeds on the course's offline corpus; one line per seed. The printed lines above the figure give the final losses, the gaps and the times.", "name": "fig-k3-vs-gpt2"}, "image": {"alt": "A line plot of validation loss against training steps, one colour per model (tiny K3 and GPT-2), solid and dashed lines for the two seeds. All lines start above 3 nats per byte and fall over the steps; the printed lines above the figure say which model ends lower and by how much."}}
fig, ax = plt.subplots(figsize=(6.2, 3.4), layout="constrained")
for (name, seed), r in runs.items():
    ax.plot(r.val_steps, r.val_loss, marker="o", ms=3, ls=("-", "--")[seed % 2],
            color="C0" if name == "tiny K3" else "C1", label=f"{name}, seed {seed}")
ax.set_xlabel("training step")
ax.set_ylabel("validation loss (nats per byte)")
ax.set_title(f"Same budget: {STEPS} steps of {BATCH} x {CONTEXT} bytes", fontsize=10)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# What this can and cannot show. At this size and budget the models learn the byte statistics
# and the common words of the corpus; the printed gaps say which ends lower and by how much, for
# each seed (two seeds are a spread of two, not a confidence interval). The comparison is not a
# contest of equals: the learning rate (3e-3) and schedule are the course's defaults, tuned for
# neither model; the tiny K3 runs each token through two of eight routed experts, so it uses
# fewer parameters per token than it has (printed above), while its chunked KDA layers and
# per-expert loops make each CPU step slower (the time ratio above), so at equal *time* it
# would get fewer steps. What it does show is that the pieces of this chapter, assembled,
# train, under the same loop as every model of the course. Nothing here says how K3 compares
# with a transformer at scale.
#
# No published checkpoint is loaded in this chapter, not even optionally: K3 has 2.8T
# parameters, and no small model in its format is published. `tinyk3.models.from_checkpoint`
# reads the released format (the `text_config`, the checkpoint's own tensor names), which the
# course's tests check at a tiny random configuration against mlx-lm.
#
# ## Exercises
#
# ```{exercise} One attention-residual read
# :label: ex-k3-depth-mix
#
# Write `depth_mix(sources, w_norm, w_proj, eps)`: one read of block attention residuals.
# `sources [S, B, T, d]` are the completed block sums (the embedding first) and, last, the
# partial sum; `w_norm [d]` and `w_proj [d]` are the read's RMSNorm weight and projection. Give
# each source the logit $(s / \operatorname{rms}(s)) \cdot (w_{\text{norm}} \odot
# w_{\text{proj}})$ with $\operatorname{rms}(s) = \sqrt{\operatorname{mean}(s^2) + \epsilon}$,
# take the softmax over the sources for each token, and return the weighted sum of the raw
# sources, `[B, T, d]`, in `sources`' dtype.
# ```

# %%
def depth_mix_exercise_mine(sources, w_norm, w_proj, eps):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("kimi_k3.depth_mix", depth_mix_exercise_mine)

# %% [markdown]
# ```{solution-start} ex-k3-depth-mix
# :class: dropdown
# ```

# %%
def depth_mix_solution(sources, w_norm, w_proj, eps):
    src = sources.double()
    keys = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps)
    p = (keys @ (w_norm * w_proj).double()).softmax(dim=0)  # over depth
    return (p.unsqueeze(-1) * src).sum(0).to(sources.dtype)


ok = checks.run("kimi_k3.depth_mix", depth_mix_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} SiTU-GLU
# :label: ex-k3-situ
#
# Write `situ_glu(gate, up)`: $4 \tanh(g/4)\, \sigma(g) \cdot 25 \tanh(u/25)$ elementwise, in
# `gate`'s dtype. The cases include inputs large enough for both caps to matter, and negative
# gates.
# ```

# %%
def situ_glu_mine(gate, up):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("kimi_k3.situ_glu", situ_glu_mine)

# %% [markdown]
# ```{solution-start} ex-k3-situ
# :class: dropdown
# ```

# %%
def situ_glu_solution(gate, up):
    g, u = gate.double(), up.double()
    y = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    return y.to(gate.dtype)


ok = checks.run("kimi_k3.situ_glu", situ_glu_solution)

# %% [markdown]
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - Kimi K3 is Kimi Linear's hybrid at larger size (93 layers: KDA in 69, NoPE MLA in 24,
#   every fourth counted from 1 and the last), with five changes, each built here and checked
#   against `tinyk3` (and mlx-lm where installed).
# - **Block attention residuals**: every sub-layer reads a softmax over depth of the completed
#   block sums and the current partial sum, with RMS-normed keys against one learned vector, no
#   $1/\sqrt{d}$, raw values; a block every 12 layers; a final read before the head. A block
#   per layer mixes every earlier output. It does not reduce to the plain residual sum; with
#   zero read vectors (the initialisation) it computes the plain-residual model up to the
#   norms' $\epsilon$, at any block size, and learned read vectors move it away.
# - **SiTU-GLU**, $4\tanh(g/4)\sigma(g) \cdot 25\tanh(u/25)$: SiLU-GLU near zero, bounded by
#   100 in magnitude.
# - **The latent MoE**: routed experts in a 3,584-wide latent, RMSNorm after the weighted sum,
#   then back up; router and shared experts at full width. It halves the routed experts'
#   weights and work for two projections per layer.
# - **Gates**: a sigmoid output gate on MLA, computed from the layer's input (nothing added to
#   the cache); KDA's decay bounded below by $-5$ per step and its output gate full rank.
# - A tiny K3-shaped model decodes through its cache to the full forward's logits; the
#   released configuration counts about 2.78T total and 105B active against the announced
#   2.8T / 104B, the routed experts holding almost all of it; the title's ratio is about
#   22,580, 22,501 or 22,336, depending on which counts are divided; at a million tokens the
#   MLA caches dominate the decoding memory, the 69 KDA states are small beside them.
# - Trained for the same steps on the course's corpus, the tiny K3 and a GPT-2 of the same
#   total size both learn; the gaps printed in the experiment say which ended lower for each
#   seed, at untuned, shared hyper-parameters and a slower CPU step for the tiny K3.
#
# The distances this run measured:

# %%
for key, value in RESULTS.items():
    print(f"{key:>58s}: {value:.1e}")

# %% [markdown]
# **Next.** [The road compared](18_the_road_compared.ipynb) puts every mechanism of the course
# in one tiny model, trained on one data set.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
