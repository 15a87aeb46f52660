"""tinyk3.attention: the three forms of causal attention agree, and misuse fails clearly."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tinyk3.attention import (
    causal_attention,
    causal_attention_loop,
    causal_attention_sdpa,
    causal_mask,
)

# Tolerances: float64 forms differ only by summation order; float32 by a few ulps of O(1) values.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
FORMS = [causal_attention_loop, causal_attention, causal_attention_sdpa]
FAST_FORMS = [causal_attention, causal_attention_sdpa]

# (B, H, Tq, Tk, D, Dv)
SHAPES = [
    (1, 1, 1, 1, 4, 4),  # a single token
    (2, 3, 5, 5, 8, 8),  # square, the training case
    (1, 2, 16, 16, 16, 16),
    (2, 2, 1, 9, 8, 8),  # decoding: one new query over a cache
    (1, 2, 4, 11, 8, 8),  # a block of new queries over a cache (bottom-right mask)
    (2, 1, 3, 7, 8, 5),  # Tq < Tk and Dv != D
    (1, 3, 6, 6, 4, 12),  # Dv > D
]


def _qkv(B, H, Tq, Tk, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, Tk, D, generator=g, dtype=dtype)
    v = torch.randn(B, H, Tk, Dv, generator=g, dtype=dtype)
    return q, k, v


def _independent(q, k, v):
    """An oracle written separately from the lib: explicit weights, position by position."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    out = torch.empty(B, H, Tq, v.shape[-1], dtype=q.dtype)
    for i in range(Tq):
        pos = Tk - Tq + i  # absolute position of query i
        s = torch.einsum("bhd,bhjd->bhj", q[:, :, i], k[:, :, : pos + 1]) / math.sqrt(D)
        w = torch.exp(s - s.amax(-1, keepdim=True))
        w = w / w.sum(-1, keepdim=True)
        out[:, :, i] = torch.einsum("bhj,bhjd->bhd", w, v[:, :, : pos + 1])
    return out


def _max_err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Tq{}Tk{}D{}Dv{}".format(*s))
def test_forms_agree_with_reference_and_oracle(shape, dtype):
    q, k, v = _qkv(*shape, dtype)
    ref = causal_attention_loop(q, k, v)
    B, H, Tq, _, _, Dv = shape
    assert ref.shape == (B, H, Tq, Dv)
    assert ref.dtype == dtype
    assert _max_err(ref, _independent(q, k, v)) <= TOL[dtype]
    for form in FAST_FORMS:
        out = form(q, k, v)
        assert out.shape == ref.shape and out.dtype == dtype, form.__name__
        err = _max_err(out, ref)
        assert err <= TOL[dtype], f"{form.__name__}: max abs error {err:.3g}"


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("Tq", [1, 3, 8])
def test_queries_are_the_last_positions(form, Tq):
    """With Tq < Tk, the output equals the last Tq rows of full causal attention."""
    Tk = 8
    q, k, v = _qkv(2, 2, Tk, Tk, 8, 8, torch.float64, seed=1)
    full = causal_attention_loop(q, k, v)  # every position queries
    out = form(q[:, :, -Tq:], k, v)
    assert _max_err(out, full[:, :, -Tq:]) <= 1e-12


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_first_token_sees_only_itself_and_last_sees_everything(form):
    q, k, v = _qkv(2, 3, 6, 6, 8, 5, torch.float64, seed=2)
    out = form(q, k, v)
    # Query 0 has one key: softmax weight exactly 1 on it.
    assert _max_err(out[:, :, 0], v[:, :, 0]) <= 1e-12
    # The last query sees every key: plain (unmasked) softmax attention.
    w = (q[:, :, -1:] @ k.transpose(-1, -2) / math.sqrt(8)).softmax(-1)
    assert _max_err(out[:, :, -1:], w @ v) <= 1e-12


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("Tq,Tk", [(6, 6), (3, 7)])
def test_future_keys_do_not_matter(form, Tq, Tk):
    """Changing key/value j leaves exactly the queries that cannot see j unchanged."""
    q, k, v = _qkv(1, 2, Tq, Tk, 4, 4, torch.float64, seed=3)
    base = form(q, k, v)
    offset = Tk - Tq
    for j in range(offset + 1, Tk):  # keys some query cannot see
        k2, v2 = k.clone(), v.clone()
        k2[:, :, j] += 5.0
        v2[:, :, j] -= 3.0
        out = form(q, k2, v2)
        blind = j - offset  # queries 0 .. blind-1 sit before position j
        assert torch.equal(out[:, :, :blind], base[:, :, :blind]), f"key {j} leaked"
        assert _max_err(out[:, :, blind:], base[:, :, blind:]) > 1e-3  # and it is used after


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_gradients(form):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 3, 5, 4, 3, torch.float64, seed=4))
    assert torch.autograd.gradcheck(form, (q, k, v), eps=1e-6, atol=1e-7)


def test_causal_mask_values():
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(3), expected)
    assert torch.equal(causal_mask(3, 3), expected)
    # two new queries after two cached keys: bottom-right aligned
    expected = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(2, 4), expected)
    assert torch.equal(causal_mask(1, 5), torch.ones(1, 5, dtype=torch.bool))


@pytest.mark.parametrize("t_q,t_k", [(1, 1), (4, 4), (1, 7), (3, 9), (9, 9)])
def test_causal_mask_formula(t_q, t_k):
    m = causal_mask(t_q, t_k)
    assert m.dtype == torch.bool and m.shape == (t_q, t_k)
    i = torch.arange(t_q)[:, None]
    j = torch.arange(t_k)[None, :]
    assert torch.equal(m, j <= (t_k - t_q) + i)
    assert m.sum().item() == sum(t_k - t_q + i + 1 for i in range(t_q))


def test_causal_mask_rejects_more_queries_than_keys():
    with pytest.raises(ValueError, match="t_q=5 > t_k=3"):
        causal_mask(5, 3)


def test_sdpa_is_causal_is_top_left_aligned_when_tq_lt_tk():
    """Why causal_attention_sdpa builds an explicit mask: PyTorch's ``is_causal=True`` aligns
    the mask top-left, so with Tq < Tk the new queries would not see the cached keys."""
    q, k, v = _qkv(1, 2, 3, 7, 8, 8, torch.float64, seed=5)
    torch_causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    top_left = torch.ones(3, 7, dtype=torch.bool).tril()  # query i sees keys 0..i
    explicit_top_left = F.scaled_dot_product_attention(q, k, v, attn_mask=top_left)
    assert _max_err(torch_causal, explicit_top_left) <= 1e-12
    ours = causal_attention_sdpa(q, k, v)
    assert _max_err(ours, causal_attention_loop(q, k, v)) <= 1e-12
    assert _max_err(torch_causal, ours) > 0.1  # top-left != bottom-right
    # With Tq == Tk both alignments coincide, which is why the square case may use is_causal.
    q, k, v = _qkv(1, 2, 7, 7, 8, 8, torch.float64, seed=6)
    assert _max_err(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    causal_attention(q, k, v)) <= 1e-12


# -- misuse -----------------------------------------------------------------------------------

def _bad_inputs():
    f32, f64 = torch.float32, torch.float64
    q, k, v = _qkv(2, 2, 4, 4, 8, 8, f32)
    return [
        ("3-D q", (q[0], k, v), ValueError, r"q must have shape \[B, H, T, D\], got \(2, 4, 8\)"),
        ("5-D v", (q, k, v[None]), ValueError, r"v must have shape \[B, H, T, D\]"),
        ("batch mismatch", (q, k[:1], v[:1]), ValueError, "shapes do not fit"),
        ("heads mismatch", (q[:, :1], k, v), ValueError, "shapes do not fit"),
        ("k/v length mismatch", (q, k, v[:, :, :3]), ValueError, "shapes do not fit"),
        ("head size mismatch", (q, k[..., :4], v), ValueError, "same head size, got 8 and 4"),
        ("int q", (q.long(), k, v), TypeError, "floating-point tensor, got torch.int64"),
        ("int v", (q, k, v.int()), TypeError, "v must be a floating-point"),
        ("mixed dtypes", (q, k.to(f64), v), TypeError, "share a dtype"),
        ("Tq > Tk", (q, k[:, :, :2], v[:, :, :2]), ValueError,
         r"more queries \(4\) than keys \(2\)"),
        ("list q", (q.tolist(), k, v), TypeError, "q must be a torch.Tensor, got list"),
    ]


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_inputs_raise_clear_errors(form, case):
    _, args, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        form(*args)
