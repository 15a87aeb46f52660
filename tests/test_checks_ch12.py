"""Chapter 12's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants, some of
them through the library's own layer pieces.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from helpers import right, run, wrong
from tinyk3 import checks, gates
from tinyk3.layers import ShortConvolution
from tinyk3.layers.kda import l2_normalize

# -- kda_layer.conv_step ----------------------------------------------------------------------------


def _learner_conv(x, state, weight, *, bug=None):
    """A learner's step, written with a loop over the taps; `bug` names the one thing done wrong."""
    K = weight.shape[-1]
    inputs = [state[:, :, i] for i in range(K - 1)] + [x]  # oldest first
    if bug == "flip":
        inputs = inputs[::-1]
    if bug == "act_inside":
        acc = sum(weight[:, i] * F.silu(inputs[i]) for i in range(K))
    else:
        acc = sum(weight[:, i] * inputs[i] for i in range(K))
    y = acc if bug in ("no_act", "act_inside") else acc * torch.sigmoid(acc)
    if bug == "flip":
        inputs = inputs[::-1]
    if bug == "keep":
        new = state
    elif bug == "outputs":
        new = torch.stack(inputs[1:-1] + [y], dim=-1) if K > 1 else state
    elif bug == "relu":
        y = torch.relu(acc)
        new = torch.stack(inputs[1:], dim=-1) if K > 1 else state
    else:
        new = torch.stack(inputs[1:], dim=-1) if K > 1 else state
    return y, new


@wrong("kda_layer.conv_step", "flipped_taps")
def cs_flipped(x, state, weight):
    return _learner_conv(x, state, weight, bug="flip")


@wrong("kda_layer.conv_step", "no_silu")
def cs_no_activation(x, state, weight):
    return _learner_conv(x, state, weight, bug="no_act")


@wrong("kda_layer.conv_step", "silu_inside")
def cs_activation_inside(x, state, weight):
    return _learner_conv(x, state, weight, bug="act_inside")


@wrong("kda_layer.conv_step", "state_kept")
def cs_state_not_slid(x, state, weight):
    return _learner_conv(x, state, weight, bug="keep")


@wrong("kda_layer.conv_step", "state_holds_outputs")
def cs_state_of_outputs(x, state, weight):
    """Slides the state, but appends the output y where the input x belongs."""
    return _learner_conv(x, state, weight, bug="outputs")


@wrong("kda_layer.conv_step", "state_kept")
def cs_drops_newest(x, state, weight):
    """Keeps the oldest K − 1 inputs of the window: that is the old state again."""
    window = torch.cat([state, x[..., None]], dim=-1)
    y = F.silu((window * weight).sum(-1))
    return y, window[..., : weight.shape[-1] - 1]


@wrong("kda_layer.conv_step", "newest_first")
def cs_newest_first(x, state, weight):
    """Keeps the state newest first: x in front, the oldest one dropped from the end."""
    y, _ = _learner_conv(x, state, weight)
    return y, torch.cat([x[..., None], state[..., 1:]], dim=-1)


@wrong("kda_layer.conv_step")
def cs_relu(x, state, weight):
    """ReLU where SiLU belongs: no registered mistake explains it."""
    return _learner_conv(x, state, weight, bug="relu")


@right("kda_layer.conv_step")
def cs_ok_loop(x, state, weight):
    return _learner_conv(x, state, weight)


@right("kda_layer.conv_step")
def cs_ok_conv1d(x, state, weight):
    """F.conv1d over the window, as a depthwise convolution with C groups."""
    window = torch.cat([state, x[..., None]], dim=-1)  # [B, C, K]
    y = F.conv1d(window, weight[:, None, :], groups=weight.shape[0])[..., 0]
    return F.silu(y), window[..., 1:]


@right("kda_layer.conv_step")
def cs_ok_lib(x, state, weight):
    """One token through the lib's ShortConvolution, from the given state."""
    C, K = weight.shape
    conv = ShortConvolution(C, K, bias=False).to(weight.dtype)
    with torch.no_grad():
        conv.weight.copy_(weight[:, None, :])
        y, new = conv(x[:, None, :], state)
    return y[:, 0], new


# -- kda_layer.inputs -------------------------------------------------------------------------------


def _learner_inputs(q, k, b, a, A_log, dt_bias, gate, *, bug=None):
    """A learner's preprocessing: transpose first, then normalise and gate, the obvious way."""
    q, k, b, a = q.transpose(1, 2), k.transpose(1, 2), b.transpose(1, 2), a.transpose(1, 2)
    Dk = q.shape[-1]
    dim = 2 if bug == "norm_dim" else -1  # 2: the tokens, in [B, H, T, Dk]
    q = q / torch.sqrt((q**2).sum(dim, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k**2).sum(dim, keepdim=True) + 1e-6)
    if bug == "no_scale":
        pass
    elif bug == "times_sqrt":
        q = q * math.sqrt(Dk)
    else:
        q = q / math.sqrt(Dk)
    if bug == "k_scaled":
        k = k / math.sqrt(Dk)
    beta = torch.sigmoid(b)
    A = A_log.view(1, -1, 1, 1) if bug == "log_rate" else A_log.exp().view(1, -1, 1, 1)
    z = a if bug == "no_bias" else a + dt_bias[None, :, None, :]
    form = gate
    if bug == "swap_forms":
        form = "softplus" if gate == "lower_bound" else "lower_bound"
    if form == "softplus":
        g = -A * torch.log1p(torch.exp(z))
    elif bug == "rate_outside":
        g = -5 * A * torch.sigmoid(z)
    else:
        g = -5 * torch.sigmoid(A * z)
    return q, k, beta, g


@wrong("kda_layer.inputs", "no_q_scale")
def li_no_scale(*args):
    return _learner_inputs(*args, bug="no_scale")


@wrong("kda_layer.inputs", "q_scaled_up")
def li_times_sqrt(*args):
    return _learner_inputs(*args, bug="times_sqrt")


@wrong("kda_layer.inputs", "k_scaled")
def li_k_scaled(*args):
    return _learner_inputs(*args, bug="k_scaled")


@wrong("kda_layer.inputs", "norm_over_tokens")
def li_norm_over_tokens(*args):
    return _learner_inputs(*args, bug="norm_dim")


@wrong("kda_layer.inputs", "wrong_gate_form")
def li_swapped_forms(*args):
    return _learner_inputs(*args, bug="swap_forms")


@wrong("kda_layer.inputs", "rate_outside_sigmoid")
def li_rate_outside(*args):
    return _learner_inputs(*args, bug="rate_outside")


@wrong("kda_layer.inputs", "A_log_not_exp")
def li_log_rate(*args):
    return _learner_inputs(*args, bug="log_rate")


@wrong("kda_layer.inputs", "no_dt_bias")
def li_no_bias(*args):
    return _learner_inputs(*args, bug="no_bias")


@wrong("kda_layer.inputs")
def li_layout_kept(q, k, b, a, A_log, dt_bias, gate):
    """Right values in the projections' layout [B, T, H, ·]: a shape error, no named mistake."""
    q2, k2, beta, g = _learner_inputs(q, k, b, a, A_log, dt_bias, gate)
    return q2.transpose(1, 2), k2.transpose(1, 2), beta.transpose(1, 2), g.transpose(1, 2)


@right("kda_layer.inputs")
def li_ok(*args):
    return _learner_inputs(*args)


@right("kda_layer.inputs")
def li_ok_normalize(q, k, b, a, A_log, dt_bias, gate):
    """F.normalize (max(‖x‖, 1e-12) in the denominator) instead of fla's √(‖x‖² + 1e-6)."""
    Dk = q.shape[-1]
    q = F.normalize(q, dim=-1) / math.sqrt(Dk)
    k = F.normalize(k, dim=-1)
    z = a + dt_bias
    A = A_log.exp()[:, None]
    g = -A * F.softplus(z) if gate == "softplus" else -5 * torch.sigmoid(A * z)
    return tuple(t.transpose(1, 2) for t in (q, k, torch.sigmoid(b), g))


@right("kda_layer.inputs")
def li_ok_lib(q, k, b, a, A_log, dt_bias, gate):
    """The lib's pieces: l2_normalize and tinyk3.gates, in the operators' layout."""
    q, k, b, a = (t.transpose(1, 2) for t in (q, k, b, a))
    form = gates.softplus_gate if gate == "softplus" else gates.lower_bound_gate
    return (l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k), torch.sigmoid(b),
            form(a, A_log, dt_bias))


# -- the lists --------------------------------------------------------------------------------------


def test_the_conv_step_reference_is_the_layer_convolution_token_by_token():
    """Feeding a sequence through the reference one token at a time, from a zero state, gives
    ShortConvolution's outputs over the whole sequence and its final state (the lib's module
    is the oracle; the reference is written independently of it)."""
    ref = checks.EXERCISES["kda_layer.conv_step"].reference
    gen = torch.Generator().manual_seed(0)
    B, T, C, K = 2, 9, 5, 4
    conv = ShortConvolution(C, K, bias=False).double()
    x = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        y_full, state_full = conv(x)
    state, ys = torch.zeros(B, C, K - 1, dtype=torch.float64), []
    for t in range(T):
        y, state = ref(x[:, t], state, conv.weight.detach()[:, 0])
        ys.append(y)
    assert torch.allclose(torch.stack(ys, 1), y_full, atol=1e-12)
    assert torch.equal(state, state_full)


def test_the_inputs_reference_matches_the_layer_pieces():
    """On a KimiDeltaAttention layer of each gate form, the reference applied to the layer's
    own projections gives the layer's qkv(), log_decay() and write_strength()."""
    from tinyk3.layers import KimiDeltaAttention

    ref = checks.EXERCISES["kda_layer.inputs"].reference
    for gate in ("softplus", "lower_bound"):
        torch.manual_seed(0)
        m = KimiDeltaAttention(16, 2, 4, gate=gate, output_gate="full").double()
        x = torch.randn(2, 7, 16, dtype=torch.float64)
        with torch.no_grad():
            q_l, k_l, _, _ = m.qkv(x)
            p = torch.cat([m.q_proj(x), m.k_proj(x)], -1)
            conv = torch.cat([m.q_conv1d.weight, m.k_conv1d.weight])
            c = F.silu(F.conv1d(F.pad(p.mT, (3, 0)), conv, groups=16)).mT  # [B, T, 16]
            q, k = c.view(2, 7, 2, 2, 4).unbind(2)  # [B, T, H, Dk] each
            a = m.f_b_proj(m.f_a_proj(x)).view(2, 7, 2, 4)
            out = ref(q, k, m.b_proj(x), a, m.A_log, m.dt_bias.view(2, 4), gate)
        for mine, lib in zip(out, (q_l, k_l, m.write_strength(x), m.log_decay(x))):
            assert mine.shape == lib.shape and torch.allclose(mine, lib, atol=1e-12)


def test_the_cases_cover_what_the_mistakes_need():
    conv = checks.EXERCISES["kda_layer.conv_step"].cases()
    Ks = {c.args[2].shape[-1] for c in conv}
    assert {1, 4} <= Ks and len(Ks) >= 4
    assert {c.args[0].dtype for c in conv} == {torch.float32, torch.float64}
    assert any(not c.args[1].any() for c in conv) and any(c.args[1].abs().sum() > 0 for c in conv)
    inputs = checks.EXERCISES["kda_layer.inputs"].cases()
    assert {c.args[-1] for c in inputs} == {"softplus", "lower_bound"}
    assert {c.args[0].dtype for c in inputs} == {torch.float32, torch.float64}
    ref = checks.EXERCISES["kda_layer.inputs"].reference
    lower = [ref(*c.args)[3] for c in inputs if c.args[-1] == "lower_bound"]
    assert min(float(g.min()) for g in lower) < -4.9 and max(float(g.max()) for g in lower) > -0.1
    soft = [ref(*c.args)[3] for c in inputs if c.args[-1] == "softplus"]
    assert min(float(g.min()) for g in soft) < -5  # unbounded below: past K3's bound


def test_a_flipped_filter_is_caught_on_the_first_case():
    """K = 4 comes first, where reversing the taps changes the output: the mistake is named by
    value there, not after a run of cases where it cannot show (K = 1)."""
    result = run("kda_layer.conv_step", cs_flipped)
    assert result.mistake == "flipped_taps" and result.failed_case == 1
