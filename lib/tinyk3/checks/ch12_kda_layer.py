"""Chapter 12 exercises: one decoding step of the short convolution, and the inputs a KDA layer
hands its operator (normalised queries and keys, β and the forget gate)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .core import Case, Exercise, Mistake, register

LOWER_BOUND = -5.0  # Kimi K3's gate: g = −5 · sigmoid(exp(A_log) · (a + dt_bias))
L2_EPS = 1e-6  # fla's l2norm: x / √(Σ x² + 1e-6)

# -- kda_layer.conv_step ----------------------------------------------------------------------------


def conv_step(x, state, weight):
    """Reference: one token through a depthwise causal convolution with SiLU::

        window = [state | x]                    the last K inputs, oldest first   [B, C, K]
        y[c]   = silu(Σ_i weight[c, i] · window[c, i])
        new_state = window[:, :, 1:]            the last K − 1 inputs

    ``x [B, C]`` (one token's projected channels), ``state [B, C, K − 1]`` (the previous
    ``K − 1`` inputs, oldest first), ``weight [C, K]`` (a ``ShortConvolution``'s ``weight[:, 0]``:
    tap ``K − 1`` multiplies the newest input, as ``F.conv1d`` does). Returns
    ``(y [B, C], new_state [B, C, K − 1])``."""
    window = torch.cat([state, x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    return F.silu((window * weight).sum(-1)), window[..., 1:]


def _window(x, state):
    return torch.cat([state, x.unsqueeze(-1)], dim=-1)


def _conv_cases(gen: torch.Generator) -> list[Case]:
    def case(B, C, K, label, *, dtype=torch.float32, zero_state=False):
        x = torch.randn(B, C, generator=gen, dtype=dtype)
        state = (torch.zeros(B, C, K - 1, dtype=dtype) if zero_state
                 else torch.randn(B, C, K - 1, generator=gen, dtype=dtype))
        bound = 1 / math.sqrt(K)  # nn.Conv1d's initialisation of a depthwise filter
        weight = (2 * torch.rand(C, K, generator=gen, dtype=dtype) - 1) * bound
        return Case((x, state, weight), label=f"B={B}, C={C}, K={K}: {label}")

    return [
        case(2, 6, 4, "Kimi Linear's K = 4, a state from earlier tokens"),
        case(1, 8, 4, "the first token: the state is zeros", zero_state=True),
        case(3, 5, 3, "K = 3"),
        case(2, 4, 2, "K = 2: the state is one token"),
        case(1, 7, 6, "K = 6"),
        case(2, 3, 1, "K = 1: no state at all, [B, C, 0]"),
        case(2, 6, 4, "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="kda_layer.conv_step",
    title="one decoding step of the short convolution",
    signature="conv_step(x [B, C], state [B, C, K-1], weight [C, K]) "
              "-> (y [B, C], new_state [B, C, K-1])",
    reference=conv_step,
    make_cases=_conv_cases,
    chapter=12,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("flipped_taps",
                lambda x, s, w: (F.silu((_window(x, s) * w.flip(-1)).sum(-1)),
                                 _window(x, s)[..., 1:]),
                "your taps run the wrong way: weight[:, K-1] belongs to the NEWEST input (x), "
                "weight[:, 0] to the oldest in the state. F.conv1d (and so ShortConvolution) "
                "computes a cross-correlation, not a flipped convolution: "
                "(window * weight).sum(-1) with window = cat([state, x]) oldest first."),
        Mistake("no_silu",
                lambda x, s, w: ((_window(x, s) * w).sum(-1), _window(x, s)[..., 1:]),
                "the activation is missing: the layer's convolution ends in SiLU, "
                "y = silu(Σ_i weight[:, i] · window[:, i])."),
        Mistake("silu_inside",
                lambda x, s, w: ((F.silu(_window(x, s)) * w).sum(-1), _window(x, s)[..., 1:]),
                "you applied SiLU to the inputs before the weighted sum: the filter is linear, "
                "SiLU comes after it, y = silu((window * weight).sum(-1))."),
        Mistake("state_kept",
                lambda x, s, w: (F.silu((_window(x, s) * w).sum(-1)), s),
                "your new state is the old one (the window without x is the old state): it must "
                "slide by one token, the oldest input leaving and x arriving, so that the next "
                "step sees x. Return the last K − 1 inputs of the window, window[:, :, 1:]."),
        Mistake("state_holds_outputs",
                lambda x, s, w: (F.silu((_window(x, s) * w).sum(-1)), torch.cat(
                    [s[..., 1:], F.silu((_window(x, s) * w).sum(-1)).unsqueeze(-1)], dim=-1)),
                "your state slides, but it stores the convolution's OUTPUT y: the state holds "
                "its INPUTS, the last K − 1 projected tokens (x here), since the next step "
                "filters inputs. new_state = window[:, :, 1:]."),
        Mistake("newest_first",
                lambda x, s, w: (F.silu((_window(x, s) * w).sum(-1)),
                                 torch.cat([x.unsqueeze(-1), s[..., 1:]], dim=-1)),
                "your new state puts x first: the state is ordered oldest first, like the "
                "window, so x goes last: window = cat([state, x]), new_state = window[:, :, 1:]."),
    ],
    hint="window = torch.cat([state, x.unsqueeze(-1)], dim=-1) ([B, C, K], oldest first); "
         "y = F.silu((window * weight).sum(-1)); new_state = window[:, :, 1:].",
))


# -- kda_layer.inputs -------------------------------------------------------------------------------


def layer_inputs(q, k, b, a, A_log, dt_bias, gate):
    """Reference: what a KDA layer hands its operator, from the convolution's outputs and the
    gates' projections::

        q ← l2(q) · Dk^-½,  k ← l2(k)             l2(x) = x / √(Σ x² + 1e-6), per head
        β = sigmoid(b)
        g = −exp(A_log) · softplus(a + dt_bias)             gate == "softplus" (Kimi Linear)
        g = −5 · sigmoid(exp(A_log) · (a + dt_bias))        gate == "lower_bound" (Kimi K3)

    ``q, k [B, T, H, Dk]``, ``b [B, T, H]``, ``a [B, T, H, Dk]``, ``A_log [H]``,
    ``dt_bias [H, Dk]``. Returns ``q, k [B, H, T, Dk]``, ``beta [B, H, T]``, ``g [B, H, T, Dk]``
    (the operators' layout), in the inputs' dtype."""
    Dk = q.shape[-1]
    q = _l2(q) * Dk ** -0.5
    k = _l2(k)
    beta = torch.sigmoid(b)
    A = A_log.exp()[:, None]  # [H, 1]: one rate per head
    z = a + dt_bias  # [B, T, H, Dk]
    g = -A * F.softplus(z) if gate == "softplus" else LOWER_BOUND * torch.sigmoid(A * z)
    return _heads_first(q, k, beta, g)


def _l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _heads_first(q, k, beta, g):
    return q.transpose(1, 2), k.transpose(1, 2), beta.transpose(1, 2), g.transpose(1, 2)


def _gate(a, A_log, dt_bias, gate, *, exp_A=True, bias=True, rate_outside=False):
    A = (A_log.exp() if exp_A else A_log)[:, None]
    z = a + dt_bias if bias else a
    if gate == "softplus":
        return -A * F.softplus(z)
    if rate_outside:
        return LOWER_BOUND * A * torch.sigmoid(z)
    return LOWER_BOUND * torch.sigmoid(A * z)


def _inputs_variant(q, k, b, a, A_log, dt_bias, gate, *, q_scale=None, k_scale=1.0,
                    norm_dim=-1, **gate_kw):
    """The reference with one piece changed (a mistake)."""
    Dk = q.shape[-1]
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, Dk]
    if norm_dim == -1:
        qh, kh = _l2(qh), _l2(kh)
    else:  # over the tokens instead of the channels
        qh = qh * torch.rsqrt((qh * qh).sum(norm_dim, keepdim=True) + L2_EPS)
        kh = kh * torch.rsqrt((kh * kh).sum(norm_dim, keepdim=True) + L2_EPS)
    qh = qh * (Dk ** -0.5 if q_scale is None else q_scale(Dk))
    kh = kh * (k_scale(Dk) if callable(k_scale) else k_scale)
    g = _gate(a, A_log, dt_bias, gate, **gate_kw).transpose(1, 2)
    return qh, kh, torch.sigmoid(b).transpose(1, 2), g


def _inputs_cases(gen: torch.Generator) -> list[Case]:
    def case(B, T, H, Dk, gate, label, *, spread=2.0, dtype=torch.float32):
        def rnd(*shape):
            return torch.randn(*shape, generator=gen, dtype=dtype)

        q, k = 1.5 * rnd(B, T, H, Dk), rnd(B, T, H, Dk)
        b = 2 * rnd(B, T, H)
        a = spread * rnd(B, T, H, Dk)
        A_log = torch.empty(H, dtype=dtype).uniform_(-1.0, 2.5, generator=gen)
        dt_bias = rnd(H, Dk) - 1.0
        return Case((q, k, b, a, A_log, dt_bias, gate),
                    label=f"B={B}, T={T}, H={H}, Dk={Dk}, gate={gate!r}: {label}")

    return [
        case(2, 5, 3, 8, "lower_bound", "Kimi K3's gate"),
        case(1, 6, 2, 8, "softplus", "Kimi Linear's gate"),
        case(2, 3, 4, 16, "lower_bound", "large pre-activations: gates near −5 and near 0",
             spread=8.0),
        case(1, 7, 2, 4, "softplus", "Dk = 4"),
        case(1, 4, 3, 6, "softplus", "large pre-activations: softplus is unbounded",
             spread=8.0),
        case(2, 4, 2, 8, "lower_bound", "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="kda_layer.inputs",
    title="the operator's inputs from one KDA layer's projections",
    signature="layer_inputs(q [B, T, H, Dk], k [B, T, H, Dk], b [B, T, H], a [B, T, H, Dk], "
              "A_log [H], dt_bias [H, Dk], gate) -> (q, k [B, H, T, Dk], beta [B, H, T], "
              "g [B, H, T, Dk])",
    reference=layer_inputs,
    make_cases=_inputs_cases,
    chapter=12,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("no_q_scale", lambda *c: _inputs_variant(*c, q_scale=lambda D: 1.0),
                "your queries are unit vectors but not scaled: the layer multiplies them by "
                "Dk^-½ after the L2 norm (the operators do not scale)."),
        Mistake("q_scaled_up", lambda *c: _inputs_variant(*c, q_scale=lambda D: D ** 0.5),
                "you multiplied the queries by √Dk: the scale is Dk^-½, q = l2(q) / √Dk."),
        Mistake("k_scaled", lambda *c: _inputs_variant(*c, k_scale=lambda D: D ** -0.5),
                "you scaled the keys too: only q gets Dk^-½. The keys must stay unit vectors, "
                "or the delta rule's I − β kᵀk is no longer a projection scaled by β."),
        Mistake("norm_over_tokens", lambda *c: _inputs_variant(*c, norm_dim=-2),
                "you normalised over the tokens (or the heads), not over the channels of one "
                "head: each q_t and k_t of each head is made a unit vector, l2 over the last "
                "(Dk) dimension."),
        Mistake("wrong_gate_form",
                lambda q, k, b, a, A, dt, gate: _inputs_variant(
                    q, k, b, a, A, dt, "lower_bound" if gate == "softplus" else "softplus"),
                "you used the other gate form: gate='softplus' (Kimi Linear) is "
                "−exp(A_log)·softplus(a + dt_bias), gate='lower_bound' (Kimi K3) is "
                "−5·sigmoid(exp(A_log)·(a + dt_bias))."),
        Mistake("rate_outside_sigmoid",
                lambda *c: _inputs_variant(*c, rate_outside=True),
                "in the lower-bound gate the rate exp(A_log) multiplies the sigmoid's "
                "argument, not its output: −5·sigmoid(exp(A_log)·(a + dt_bias)) lies in "
                "(−5, 0) whatever A_log is; −5·exp(A_log)·sigmoid(·) does not."),
        Mistake("A_log_not_exp", lambda *c: _inputs_variant(*c, exp_A=False),
                "A_log is the LOGARITHM of the rate: use A = exp(A_log)."),
        Mistake("no_dt_bias", lambda *c: _inputs_variant(*c, bias=False),
                "dt_bias is missing: the gate's argument is a + dt_bias (one bias per head "
                "and channel, [H, Dk], broadcast over B and T)."),
    ],
    hint="q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * Dk ** -0.5 (k the same "
         "without the scale); beta = sigmoid(b); A = A_log.exp()[:, None] ([H, 1], against "
         "[B, T, H, Dk]); z = a + dt_bias; g = -A * softplus(z) or -5 * sigmoid(A * z); then "
         ".transpose(1, 2) each, to [B, H, T, ·].",
))
