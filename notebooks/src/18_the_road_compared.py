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
# # The road compared
#
# Seventeen chapters built one mechanism at a time, each measured against the one before it on
# the experiment that showed why it was needed. This closing page puts them side by side: every
# token mixer of the course in the same tiny language model, trained on the same data with the
# same budget, and measured in the same four ways.
#
# - **Loss**: validation loss on the course's corpus after the same training steps.
# - **Associative recall**: multi-query associative recall (chapter 4's memory and chapter 5's
#   MQAR task), trained from two seeds.
# - **Decode time**: the time of one generated token at a short and a long context.
# - **Memory**: the bytes of the decoding state, split into a part that is fixed and a part that
#   grows with every token of context.
#
# **What to expect.** A table from one small model, a few minutes of CPU and one or two
# seeds is a summary of the course, not a ranking of architectures: at this size the
# differences in loss are small and partly noise, and recall depends on how fast a model
# learns the task as much as on what its state can hold. The memory and decode columns are the
# solid ones: they follow from the mechanisms and are measured, not fitted. The section after
# the table says which differences the measurements can carry.
#
# **Cost.** Under three minutes on one CPU core, most of it training (the last cell prints the
# time); `SMOKE = True` runs in seconds.

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
import inspect
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

from tinyk3 import checks, compare, data
from tinyk3.bench import stamp
from tinyk3.data import MQARHeldOut, mqar_sampler
from tinyk3.models import LM, count_parameters
from tinyk3.timing import distinguishable
from tinyk3.train import train_batches, train_lm
from tinyk3.util import max_diff

LM_STEPS = 3 if SMOKE else 60  # language-model training steps, every mechanism
MQAR_STEPS = 10 if SMOKE else 160  # recall training steps, every mechanism and seed
SEEDS = (0,) if SMOKE else (0, 1)  # recall seeds (initialisation and data both change)
CONTEXTS = (64, 256) if SMOKE else (512, 8192)  # decode time measured at these lengths
GROWTH_AT = (32, 64) if SMOKE else (256, 512)  # cache bytes measured at these lengths
ROUNDS = 2 if SMOKE else 5  # rounds of decode timing, the two contexts in turn
MECHANISMS = compare.MECHANISMS

# %% [markdown]
# ## One model, nine mixers
#
# `tinyk3.compare.tiny_config(name)` builds the model of each mechanism. Everything but the
# token mixer is the same for all of them: two layers of width 64, two heads of 32 channels,
# a SwiGLU feed-forward twice as wide, RMSNorm, an untied head and no learned positions, so
# every model runs at any context. Order comes from the mixers themselves: the recurrent ones
# see it in their state and their short convolution, the attention-only models from RoPE on
# queries and keys (chapter 13), without which attention cannot tell one position from another.
# The last row also changes what Kimi K3 changes around the mixers. Its docstring lists the
# rows:

# %%
doc = inspect.getdoc(compare.tiny_config)
print(doc[doc.index("* "):])

# %% [markdown]
# Two softmax rows: GPT-2's attention has no convolution, while every linear mixer of the
# course carries a 4-tap one on q, k and v (chapter 5 added it for the recall task, chapter 12
# built it into the KDA layer). The second softmax row has it too, so that the table can tell
# what the convolution does from what the mixer does. MLA, as DeepSeek and Kimi build it, has
# none; the all-MLA row carries DeepSeek's shared RoPE key, while the hybrids' MLA layer is
# Kimi's, without RoPE, with a KDA layer below it to supply the order.
#
# The parameter counts differ a little: each mixer has its own projections and gates. The tiny
# K3 is the largest, because it holds 8 routed experts of which each token uses 2; its active
# count is closer to the others'.

# %%
VOCAB_LM, VOCAB_MQAR = 256, 64  # bytes; MQAR's keys and values
counts = {}
for name in MECHANISMS:
    cfg = compare.tiny_config(name, vocab_size=VOCAB_LM)
    counts[name] = count_parameters(cfg)
    kinds = "".join(k[0].upper() for k in cfg.kinds)
    print(f"{name:>15s} (chapter {compare.CHAPTERS[name]:2d}): layers {kinds:>3s}, "
          f"{counts[name].total:,} parameters, {counts[name].active:,} active")

# %% [markdown]
# ## Check: every model decodes to its full forward
#
# Before measuring anything, the property every chapter checked for its own mechanism, here for
# all nine at once: a sequence fed through the cache in pieces (17 tokens, 1, then 22) gives the
# logits of the full forward, in float64. The same cell checks the parameter count by formula
# (`count_parameters`) against the built model.

# %%
def piecewise_error(name, cuts=(17, 18, 40), seed=0):
    torch.manual_seed(seed)
    model = LM(compare.tiny_config(name, vocab_size=VOCAB_LM)).double()
    idx = torch.randint(0, VOCAB_LM, (2, cuts[-1]))
    cache, pieces, start = model.new_cache(), [], 0
    with torch.no_grad():
        full = model(idx)
        for stop in cuts:
            pieces.append(model(idx[:, start:stop], cache=cache))
            start = stop
    assert model.num_parameters() == counts[name].total
    return max_diff(torch.cat(pieces, dim=1), full)


errors = {name: piecewise_error(name) for name in MECHANISMS}
for name, err in errors.items():
    print(f"{name:>15s}: decoding in pieces vs the full forward, max abs error "
          f"{err:.1e}")
print(f"largest: {max(errors.values()):.1e} (float64); parameter counts: all equal")

# %% [markdown]
# ## Memory: what the decoding state holds
#
# `compare.cache_growth` measures `cache.nbytes()` (the bytes of every tensor the cache holds)
# after two context lengths (256 and 512 tokens) and splits it into the part that does not depend on the length
# (the recurrent states, the convolution windows) and the bytes each further token adds (keys
# and values, or latents). float32, one sequence. By the formulas of the earlier chapters, a
# softmax layer adds $2 d = 128$ numbers per token (a key and a value of every head), an MLA
# layer its latent of $d/2 = 32$ and, in the all-MLA row, the shared RoPE key of 16, and a
# recurrent layer nothing; a DeltaNet-type layer keeps two $32 \times 32$ states and a
# linear-attention layer also its normaliser $z$. The cell prints the measurement next to that
# formula, `compare.cache_bytes_per_token` (the first exercise writes it):

# %%
growth = {}
for name in MECHANISMS:
    torch.manual_seed(0)
    model = LM(compare.tiny_config(name, vocab_size=VOCAB_LM))
    growth[name] = g = compare.cache_growth(model, GROWTH_AT)
    formula = compare.cache_bytes_per_token(model.config, 4)  # float32
    print(f"{name:>15s}: fixed {g.fixed:8,.0f} B, per token {g.per_token:6,.0f} B "
          f"(formula {formula:5,} B), at 1M tokens {g.at(2**20) / 2**20:7.2f} MiB")
assert all(g.per_token == compare.cache_bytes_per_token(
    compare.tiny_config(n, vocab_size=1), 4) for n, g in growth.items())

# %% [markdown]
# Three groups. The softmax rows and MLA grow without bound (MLA more slowly: 48 numbers per
# token instead of 128 in each layer); the recurrent rows hold a fixed state of a
# few tens of kilobytes at any length; the hybrid and the tiny K3 grow by their one MLA layer
# only. At a million tokens (the last column) the fixed states are the same few tens of
# kilobytes, while the caches have reached the sizes printed. The softmax row without the
# convolution and MLA have no fixed part at all.
#
# ## Decode time
#
# One generated token from a context of 512 and of 8,192 tokens (filled by `compare.prefill` with
# random tokens; MLA decodes through the absorbed path, chapter 13), timed with
# `tinyk3.timing.time_fn`: the median of the runs, with the quartiles. `compare.decode_times`
# times the two contexts in turn, five rounds of at least 0.05 s each, so that a change in the
# machine's speed during the measurement falls on both alike (a step takes a few milliseconds
# at most).

# %%
decode = {}
for name in MECHANISMS:
    torch.manual_seed(0)
    model = LM(compare.tiny_config(name, vocab_size=VOCAB_LM))
    compare.absorb_mla(model)
    times = compare.decode_times(model, CONTEXTS, rounds=ROUNDS,
                                 min_seconds=0.005 if SMOKE else 0.05)
    for T in CONTEXTS:
        decode[name, T] = times[T]
short, long_ = CONTEXTS
print(f"{'':>15s}  {'T = ' + f'{short:,}':>22s}  {'T = ' + f'{long_:,}':>22s}   ratio")
for name in MECHANISMS:
    a, b = decode[name, short], decode[name, long_]
    print(f"{name:>15s}: {a * 1e3:5.2f} ms [{a.low * 1e3:5.2f}, {a.high * 1e3:5.2f}]  "
          f"{b * 1e3:5.2f} ms [{b.low * 1e3:5.2f}, {b.high * 1e3:5.2f}]  {b / a:5.2f}")
slower = [n for n in MECHANISMS
          if decode[n, long_] > decode[n, short]
          and distinguishable(decode[n, long_], decode[n, short])]
print(f"slower at T = {long_:,} than at T = {short:,}, quartile ranges apart: "
      f"{', '.join(slower) or 'none'}")
mib = {n: growth[n].at(long_) / 2**20 for n in ("MLA", "softmax")}
print(f"the cache a step reads at T = {long_:,}: MLA {mib['MLA']:.1f} MiB, "
      f"softmax {mib['softmax']:.1f} MiB")
print(stamp())

# %% [markdown]
# Read the ratio column: how much slower a token is at the long context than at the short one,
# and the line under the table, which names the rows where the difference stands out of the
# noise (their quartile ranges do not overlap). Where the state is fixed, the step does the
# same work at any length. Where the cache grows, the step reads all of it: a softmax layer
# reads 128 numbers per cached token, an MLA layer its 48 (the latent and the RoPE key), and
# at this width the few mebibytes printed are little beside the fixed cost of a step, so
# MLA's growth may or may not stand out of the noise. The absolute times say little: at width 64 a decode step
# is mostly Python and small-tensor overhead, which is why the recurrent rows, with more small
# operations per token, need not be faster even at the long context. Chapter 12 measured where
# a real-sized KDA step overtakes a KV cache.
#
# ## Training: loss and recall
#
# Each mechanism is trained twice from scratch, on two tasks.
#
# - **Language modelling**: the course's offline corpus (Python's documentation, bytes as
#   tokens), with the same steps, batch of 16 windows of 128 bytes, AdamW at $3 \cdot 10^{-3}$,
#   warm-up and cosine schedule (`tinyk3.train.train_lm`), seed 0; the validation loss in nats
#   per byte at the end.
# - **Recall**: MQAR with 64 token ids, one to eight pairs per batch of 32, answers not shown
#   (chapter 5's setting), AdamW at $10^{-2}$ (`train_batches`), from each seed; recall is
#   measured on held-out sequences at 2 to 32 pairs, beyond the 8 of training.

# %%
corpus = data.encode(data.load_corpus())
train_data, val_data = data.split(corpus)
UNIGRAM = data.unigram_entropy(train_data)  # chapter 1's baseline
print(f"the baseline to beat: byte frequencies alone, {UNIGRAM:.3f} nats/byte "
      f"(chapter 1)")
EVAL_PAIRS = [2, 4, 8] if SMOKE else [2, 4, 8, 16, 32]
N_EVAL = 64 if SMOKE else 128  # held-out sequences per pair count
mqar_batch = mqar_sampler(32, 8, VOCAB_MQAR)  # chapter 5's: one P in 1..8 per batch
recall_at = MQARHeldOut(EVAL_PAIRS, N_EVAL, VOCAB_MQAR).accuracy  # seed 1000 + P


lm_runs, recall, seconds = {}, {}, {}
for name in MECHANISMS:
    torch.manual_seed(0)
    model = LM(compare.tiny_config(name, vocab_size=VOCAB_LM))
    lm_runs[name] = r = train_lm(model, train_data, val_data, steps=LM_STEPS,
                                 batch_size=16, block_size=128, lr=3e-3,
                                 warmup=min(10, LM_STEPS), eval_every=LM_STEPS, seed=0,
                                 progress=False)
    seconds[name] = r.seconds
    for seed in SEEDS:
        torch.manual_seed(seed)
        model = LM(compare.tiny_config(name, vocab_size=VOCAB_MQAR))
        res = train_batches(model, mqar_batch, steps=MQAR_STEPS, lr=1e-2, seed=seed,
                            warmup=MQAR_STEPS // 10, eval_every=MQAR_STEPS,
                            progress=False)
        recall[name, seed] = [recall_at(model, P) for P in EVAL_PAIRS]
        seconds[name] += res.seconds
    at8 = ", ".join(f"{recall[name, s][EVAL_PAIRS.index(8)]:.2f}" for s in SEEDS)
    print(f"{name:>15s}: validation loss {r.val_loss[-1]:.3f}, recall at 8 pairs {at8} "
          f"({seconds[name]:.0f} s)")

# %% [markdown]
# ## The table
#
# Every column measured above, in one place: the validation loss (seed 0), recall at 8 pairs
# (inside the training range) and at 32 (four times beyond it) as the worst and best seed, the
# decode step at the long context, and the decoding state at a million tokens, extrapolated
# from the two measured lengths.

# %%
P8, P32 = EVAL_PAIRS.index(8), len(EVAL_PAIRS) - 1
rows = {}
for name in MECHANISMS:
    r8 = [recall[name, s][P8] for s in SEEDS]
    r32 = [recall[name, s][P32] for s in SEEDS]
    rows[name] = dict(loss=lm_runs[name].val_loss[-1], r8=(min(r8), max(r8)),
                      r32=(min(r32), max(r32)), ms=decode[name, long_] * 1e3,
                      mib=growth[name].at(2**20) / 2**20)
last = f"recall, {EVAL_PAIRS[-1]}"
print(f"{'':>15s} {'loss':>6s} {'recall, 8 pairs':>16s} {last:>13s} {'ms/token':>9s} "
      f"{'MiB at 1M':>10s}")
for name, row in rows.items():
    print(f"{name:>15s} {row['loss']:6.3f} {row['r8'][0]:7.2f}-{row['r8'][1]:.2f}"
          f" {row['r32'][0]:8.2f}-{row['r32'][1]:.2f} {row['ms']:9.2f}"
          f" {row['mib']:10.2f}")
print(f"(decode at T = {long_:,}; recall: worst-best of {len(SEEDS)} seed(s); "
      f"chance at P pairs is 1/P)")

# %% mystnb={"figure": {"caption": "Every token mixer of the course in the same two-layer model of width 64. Left: validation loss on the course's corpus after the same training steps (seed 0; lower is better), with the loss of byte frequencies alone dashed. Middle: recall on held-out multi-query associative recall at 8 pairs, one marker per seed (higher is better; the dotted line is chance). Right: the decoding state at a million tokens, extrapolated from two measured lengths (float32, log scale).", "name": "fig-road-compared"}, "image": {"alt": "Three panels sharing one list of nine mechanisms, from softmax at the top to tiny K3 at the bottom. Left, one dot of validation loss per mechanism, all between about 2.3 and 2.7, well left of the dashed unigram line at 3.26. Middle, two markers of recall at 8 pairs per mechanism: near the dotted chance line for softmax, MLA and Gated DeltaNet, near 1 for softmax with convolution, KDA and tiny K3, in between for the others. Right, diamonds of state size at a million tokens on a logarithmic axis: about a gigabyte for the two softmax rows, hundreds of megabytes for MLA and the hybrids, a few tens of kilobytes for the recurrent mixers."}}
names = list(MECHANISMS)
y = np.arange(len(names))[::-1]
fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(6.8, 3.6), sharey=True)
ax1.plot([rows[n]["loss"] for n in names], y, "o", color="C0", ms=5)
ax1.axvline(UNIGRAM, color="gray", ls="--", lw=1)  # byte frequencies alone
ax1.text(UNIGRAM, y[0] + 0.6, "unigram", fontsize=7, color="gray", ha="right")
ax1.set(xlabel="validation loss", yticks=y, yticklabels=names, ylim=(-0.7, len(names)))
for s, marker in zip(SEEDS, "os"):
    ax2.plot([recall[n, s][P8] for n in names], y, marker, color="C1", ms=5,
             label=f"seed {s}")
ax2.axvline(1 / 8, color="k", ls=":", lw=1, label="chance")
ax2.set(xlabel="recall at 8 pairs", xlim=(0, 1.05))
ax2.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3,
           frameon=False, handletextpad=0.2, columnspacing=0.8)
ax3.plot([rows[n]["mib"] for n in names], y, "D", color="C2", ms=5)
ax3.set(xlabel="MiB at 1M tokens", xscale="log")
plt.tight_layout()
plt.show()

# %% [markdown]
# Recall against the number of pairs, for every seed, shows which models learned the task and
# how far past the training range they carry it:

# %% mystnb={"figure": {"caption": "Held-out multi-query associative recall against the number of key-value pairs in the context (trained on 1 to 8), for every mechanism of the comparison; one line per seed (solid and dashed, in the legend of the first panel). The dotted line is chance (1/P).", "name": "fig-road-recall"}, "image": {"alt": "A grid of nine small line plots, one per mechanism, each showing recall from 0 to 1 against the number of pairs from 2 to 32 on a logarithmic axis, with a dotted chance curve falling from 0.5 to about 0.03 and a legend for the two seeds and chance in the first panel. In some panels the lines start high and fall at the larger pair counts; in others they stay near the chance curve throughout."}}
fig, axes = plt.subplots(3, 3, figsize=(6.8, 5.4), sharex=True, sharey=True)
for ax, name in zip(axes.flat, names):
    for s, ls in zip(SEEDS, ("-", "--")):
        ax.plot(EVAL_PAIRS, recall[name, s], ls, marker="o", ms=3, color="C1",
                label=f"seed {s}")
    ax.plot(EVAL_PAIRS, [1 / P for P in EVAL_PAIRS], "k:", lw=1, label="chance, 1/P")
    ax.set_title(name, fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
for ax in axes[-1]:
    ax.set_xlabel("pairs P", fontsize=8)
for ax in axes[:, 0]:
    ax.set_ylabel("recall", fontsize=8)
axes[0, 0].legend(fontsize=6, loc="upper right")
plt.tight_layout()
plt.show()

# %% [markdown]
# The mechanisms that no other beats on loss, recall (the worst seed at 8 pairs, negated: lower
# is better) and the state at a million tokens together, the table's Pareto front
# (`compare.pareto_front`). A caveat the function cannot see: a front drawn over a 60-step loss
# of one seed and recall from two is only as firm as those columns, so a row can join or leave
# it with a seed.

# %%
costs = [[rows[n]["loss"], -rows[n]["r8"][0], rows[n]["mib"]] for n in names]
print("on the front:", ", ".join(compare.pareto_front(names, costs)))

# %% [markdown]
# **A hypothesis for the gated rows.** A gated layer forgets at a rate set at initialisation:
# with a pre-activation of 0, a gate $g = -e^{A_{\log}}\operatorname{softplus}(\Delta_{\text{bias}})$
# halves the state every $\ln 2 / |g|$ tokens. Gated DeltaNet draws one such half-life per head
# (here two heads in each of two layers), KDA one per key channel (64 per layer). In the recall
# task a query comes up to $3P - 1$ tokens after its key; a head that halves its memory faster
# than that must first learn to forget more slowly. The half-lives each model starts from, per
# recall seed:

# %%
def initial_half_lives(model):
    """ln 2 / |g| at a pre-activation of 0, per head (GDN) or key channel (KDA)."""
    out = []
    for layer in model.modules():
        if not (hasattr(layer, "A_log") and hasattr(layer, "dt_bias")):
            continue
        A = layer.A_log.detach().exp()
        dt = torch.nn.functional.softplus(layer.dt_bias.detach())
        g = -A.repeat_interleave(dt.numel() // A.numel()) * dt  # per gate
        out.append(math.log(2) / -g)
    return torch.cat(out)


FAR = 3 * 8 - 1  # the longest key-to-query distance at 8 pairs
for name in ("Gated DeltaNet", "KDA"):
    for seed in SEEDS:
        torch.manual_seed(seed)
        hl = initial_half_lives(LM(compare.tiny_config(name, vocab_size=VOCAB_MQAR)))
        shown = (", ".join(f"{h:.1f}" for h in hl.tolist()) if len(hl) <= 4
                 else f"median {hl.median():.1f}")
        print(f"{name:>15s}, seed {seed}: {len(hl)} gates, half-lives {shown} tokens; "
              f"{(hl >= FAR).float().mean():.0%} reach {FAR} tokens")
# the control: seed 0's Gated DeltaNet with its forgetting switched off
torch.manual_seed(0)
still = LM(compare.tiny_config("Gated DeltaNet", vocab_size=VOCAB_MQAR))
for layer in still.modules():
    if hasattr(layer, "A_log"):
        layer.A_log.data.fill_(-20.0)  # g = −e^−20 softplus(…) ≈ 0: nothing decays
        layer.A_log.requires_grad_(False)
train_batches(still, mqar_batch, steps=MQAR_STEPS, lr=1e-2, seed=0,
              warmup=MQAR_STEPS // 10, eval_every=MQAR_STEPS, progress=False)
print(f"Gated DeltaNet, seed 0, no forgetting (A_log = -20, frozen): recall at 8 pairs "
      f"{recall_at(still, 8):.2f}")

# %% [markdown]
# The hypothesis does not hold. Gated DeltaNet's seed 1 starts with more of its half-lives
# beyond the longest key-to-query distance than either KDA seed, and still ends near chance;
# and with its forgetting switched off altogether, seed 0 recalls no better. Its gates are not
# what holds it back here; why this layer finds the recall circuit more slowly than KDA's in
# 160 steps, the table cannot say. Recall at this budget measures how fast a model finds the
# circuit as much as what its state can hold.
#
# ## What the table can and cannot carry
#
# Read the table above as the course's chapters in miniature, each column with its own
# weight of evidence.
#
# - **Memory** follows from the mechanisms exactly (the measured bytes equal the formulas),
#   and it is the column the whole road was built for: the caches grow with every token,
#   the recurrent states do not, and a hybrid pays for its attention layers only.
# - **Decode time** at the long context against the short one shows the same split, as a
#   trend in the ratio; the absolute milliseconds of a width-64 model are overhead, not the
#   cost of the mechanism.
# - **Recall** needs the two seeds: where they disagree, the model is on the edge of learning
#   the task in the steps given, and the row says more about optimisation speed than about
#   memory. Compare the two softmax rows, which differ only by the convolution. Both know
#   positions (RoPE), yet without the convolution a two-layer model must first learn to copy
#   each key into its value's position with attention alone (chapter 5), and in these steps it
#   does not: the row stays at chance, as does the MLA row, which has no convolution either,
#   while the hybrid's KDA layer brings one. With it, softmax attention recalls almost
#   perfectly at 8 pairs; at 32 pairs, in sequences four times longer than any it trained on,
#   less well (the rotations of positions it never saw are one known reason). The gated rows
#   are the other surprise: Gated DeltaNet's loss is the best of the table and its recall
#   near chance, and the hypothesis above does not explain it.
# - **Loss** after so few steps is the weakest column: differences of a few tenths of a nat,
#   one seed each, at a learning rate tuned for none of the models. It says that every
#   mechanism trains under the same loop, not which one is better at scale.
#
# What no CPU-sized table shows is why the field moved this way. The released configurations
# show it, and they answer the question the course started from.
#
# ## Is it just scale?
#
# Twenty-two thousand GPT-2s fit in one Kimi K3 by parameter count. If the road were only scale,
# everything else would have grown by that factor too: the weights each token reads, the bytes
# held for each token of context. From the two presets (`tinyk3.models.presets`, each read from
# its released configuration), with chapter 13's and 17's conventions: caches in bf16, KDA's
# fixed states in float32, and "a token reads" counting every weight a token can touch (the
# input embedding included, as `count_parameters` does):

# %%
from tinyk3.models import presets


def road_end(cfg):
    n = count_parameters(cfg)
    per_token = compare.cache_bytes_per_token(cfg, 2)  # bf16
    # the fixed part: each KDA layer's matrices and convolution windows, float32 bytes
    fixed = 4 * sum(m.state_numel(1) for m in cfg.layer_mixers if m.kind == "kda")
    full = per_token * cfg.block_size + fixed  # at the released context
    return dict(total=n.total, active=n.active, per_token=per_token, fixed=fixed,
                context=cfg.block_size, full=full)


GPT2, K3 = road_end(presets.gpt2_small()), road_end(presets.kimi_k3())
lines = (("parameters", "total", "{:,.0f}"),
         ("weights a token reads", "active", "{:,.0f}"),
         ("cache bytes per token of context", "per_token", "{:,.0f}"),
         ("fixed state bytes (KDA)", "fixed", "{:,.0f}"),
         ("context, tokens", "context", "{:,.0f}"),
         ("GB held at that context", "full", "{:,.3f}"))
print(f"{'':>33s}{'GPT-2 small':>17s}{'Kimi K3':>19s}{'K3 / GPT-2':>12s}")
for label, key, fmt in lines:
    a, b = GPT2[key], K3[key]
    a, b = (a / 1e9, b / 1e9) if key == "full" else (a, b)
    ratio = f"{b / a:,.2f}x" if a else "-"
    print(f"{label:>33s}{fmt.format(a):>17s}{fmt.format(b):>19s}{ratio:>12s}")
mla = next(m for m in presets.kimi_k3().layer_mixers if m.kind == "mla")
n_mla = presets.kimi_k3().kinds.count("mla")
mha_per_token = 2 * n_mla * mla.n_head * (mla.qk_nope_head_dim + mla.qk_rope_head_dim
                                          + mla.v_head_dim)
print(f"K3 at 1M tokens if its {n_mla} attention layers cached every head's keys and "
      f"values (MHA): {mha_per_token * K3['context'] / 1e9:,.0f} GB")
grew = (K3["total"] / GPT2["total"]) / (K3["active"] / GPT2["active"])
print(f"the parameters grew {grew:.1f} times more than the weights a token reads")

# %% [markdown]
# So: no. The parameters grew by the first ratio, but the weights a token reads grew by the
# second, smaller by the factor on the last line, because a mixture of experts (chapter 14)
# lets each token use a few percent of them. And what the model holds for every token of context went the
# other way: K3 caches fewer bytes per token than GPT-2 small, with 93 layers to GPT-2's 12,
# because 69 of its layers keep a fixed state (chapters 5 to 12) and the other 24 cache a
# latent instead of keys and values (chapter 13). That is what makes its million-token context
# fit in tens of gigabytes, where per-head keys and values would need the terabyte and a half
# of the MHA line. Training at that size needed new machinery too: Muon and QK-Clip
# (chapter 16) in place of AdamW, with logit control that GPT-2 never needed.
#
# The honest counterpoint: these are costs, not quality. Every row of the table says what it
# takes to hold and run the model; none says how good it is. What a model knows comes largely
# from what it is trained on and for how long: GPT-2 learned from WebText's 40 GB of text
# (Radford et al. 2019), Kimi K2 from 15.5 trillion tokens (its README); and scaling-law
# studies found loss to depend strongly on parameters, data and compute, and only weakly on the
# shape of the network within a wide range (Kaplan et al., arXiv 2001.08361). Whether the
# mechanisms also raise quality at equal training is a claim of the Kimi Linear report (its
# hybrid beats full MLA under one training recipe at 1.4T tokens), which a CPU course can
# reproduce in miniature at best. What the road changed, measurably, is what scale costs.
#
# ## Exercises
#
# ```{exercise} What one token of context costs
# :label: ex-compare-cache-bytes
#
# Write `cache_bytes_per_token(cfg, bytes_per_value)`: the bytes one more token of context adds
# to one sequence's decoding state, for any `LMConfig` of the course (its layers are
# `cfg.layer_mixers`, each with a `kind` and its own fields). Use the formulas of chapters 2 and
# 13, not a built model: the checker also passes the released configurations of GPT-2 small,
# DeepSeek-V3, Kimi Linear and Kimi K3 (`tinyk3.models.presets`), far too large to build. Mind
# what Kimi's MLA keeps without applying RoPE.
# ```

# %%
def cache_bytes_per_token_mine(cfg, bytes_per_value):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("compare.cache_bytes", cache_bytes_per_token_mine)

# %% [markdown]
# ```{solution-start} ex-compare-cache-bytes
# :class: dropdown
# ```

# %%
def cache_bytes_per_token_solution(cfg, bytes_per_value):
    values = 0
    for m in cfg.layer_mixers:
        if m.kind == "softmax":  # a key and a value of every head: 2 · n_embd
            values += 2 * cfg.n_embd
        elif m.kind == "mla":  # the latent and the shared key channels, rotated or not
            values += m.kv_lora_rank + m.qk_rope_head_dim
    return values * bytes_per_value  # recurrent layers: a fixed state, none per token


ok = checks.run("compare.cache_bytes", cache_bytes_per_token_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The longest context that fits
# :label: ex-compare-budget
#
# Write `tokens_in_budget(budget_bytes, fixed_bytes, bytes_per_token, max_context)`: the
# longest context $T$ (an int, at most `max_context`) at which a decoding state of
# `fixed_bytes + T * bytes_per_token` fits in `budget_bytes`; 0 when not even the fixed part
# fits. A state that does not grow fits at every length up to `max_context`.
# ```

# %%
def tokens_in_budget_mine(budget_bytes, fixed_bytes, bytes_per_token, max_context):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("compare.tokens_in_budget", tokens_in_budget_mine)

# %% [markdown]
# ```{solution-start} ex-compare-budget
# :class: dropdown
# ```

# %%
def tokens_in_budget_solution(budget_bytes, fixed_bytes, bytes_per_token, max_context):
    if fixed_bytes > budget_bytes:
        return 0
    if bytes_per_token == 0:
        return max_context
    return min(max_context, (budget_bytes - fixed_bytes) // bytes_per_token)


ok = checks.run("compare.tokens_in_budget", tokens_in_budget_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# Applied to the table's measured states, with a budget of one mebibyte and a context limit of
# a million tokens:

# %%
for name in names:
    g = growth[name]
    T = tokens_in_budget_solution(2**20, g.fixed, g.per_token, 2**20)
    print(f"{name:>15s}: {int(T):>9,} tokens in 1 MiB")

# %% [markdown]
# ## Summary
#
# - Every mixer of the course, from GPT-2's softmax attention to the tiny Kimi K3, runs in one
#   model class with one cache interface (`tinyk3.models.LM`), and each decodes through its
#   cache to its full forward's logits (the check above, float64).
# - The decoding state is where the mechanisms differ most and most surely: softmax attention
#   adds a key and a value per head per token, MLA a latent, the recurrent mixers nothing; the
#   hybrids grow by their attention layers only (measured and equal to the formulas).
# - Decode time follows the same split as a trend with context length; at this width the
#   absolute times are overhead.
# - Recall and loss trained in a couple of CPU minutes separate the models less than the
#   memory does, and the seeds show by how much. Whether a two-layer model learns recall in
#   so few steps depends on more than its mixer: the two softmax rows, both with RoPE, differ
#   only by the short convolution; Gated DeltaNet's near-chance recall is not its gates.
# - Is it just scale? No: from GPT-2 small to Kimi K3 the parameters grew about 22,000-fold,
#   the weights a token reads about 850-fold, and the cache per token of context shrank, by
#   the mechanisms of this course. That is the cost of scale, not its quality, which comes
#   largely from data and training.
#
# **Next.** The post's story ends here, at Kimi K3. Part VI goes beyond it, to training:
# [chapter 19](19_chunked_backward.ipynb) derives the backward pass of the chunked delta rule,
# which every chapter so far left to autograd. The [where to go next](../book/next.md) page
# lists what the course left out and how to extend it; the [glossary](../book/glossary.md)
# collects its terms.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
