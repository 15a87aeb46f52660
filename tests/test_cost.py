"""tinyk3.cost: the flop counts equal the closed forms, the limits, and what PyTorch's flop
counter measures on the lib's own forms."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tinyk3 import cost
from tinyk3.ops import linear_attention as la


def _counted(fn, *args, **kwargs) -> int:
    """Matmul flops PyTorch's flop counter sees when ``fn`` runs."""
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


def test_matmul_and_n_chunks():
    assert cost.matmul(3, 4, 5) == 120
    assert [cost.n_chunks(T, 4) for T in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    assert cost.n_chunks(10, 64) == 1
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError):
            cost.n_chunks(8, bad)
        with pytest.raises(ValueError):
            cost.chunked_linear_attention_flops(8, 4, bad)
        for args in ((bad, 4, 2), (8, bad, 2), (8, 4, bad)):  # T, Dk, C
            with pytest.raises(ValueError, match="cost: .* must be a positive int"):
                cost.chunked_delta_rule_flops(*args)
        with pytest.raises(ValueError, match="cost: Dv must be a positive int"):
            cost.chunked_delta_rule_flops(8, 4, 2, Dv=bad)
        with pytest.raises(ValueError, match="cost: T must be a positive int"):
            cost.sdpa_flops(bad, 4)


@pytest.mark.parametrize("T,D,C", [(4096, 64, 64), (1024, 32, 16), (640, 128, 128), (8192, 128, 1)])
def test_chunked_closed_form(T, D, C):
    """Chunked linear attention: 4TD² + 4TCD flops per head for T a multiple of C (the count of
    the module docstring: Q S and Kᵀ V, 2CD² each, and Q Kᵀ and its product with V, 2C²D each)."""
    f = cost.chunked_linear_attention_flops(T, D, C)
    assert f.state == 4 * T * D * D
    assert f.diagonal == 4 * T * C * D
    assert f.matmul == 4 * T * D * D + 4 * T * C * D
    assert f.scan == T // C * D * D
    assert f.total == f.matmul + f.scan
    assert f.sequential_steps == T // C


def test_the_posts_constants_are_half_of_each_term():
    """The post's 2Ld² + 2LCd counts one operation per multiply-add: half of each term in flops."""
    T, D, C = 4096, 64, 64
    f = cost.chunked_linear_attention_flops(T, D, C)
    assert (f.state, f.diagonal) == (2 * (2 * T * D * D), 2 * (2 * T * C * D))


def test_chunked_pads_the_last_chunk_and_separates_dk_dv():
    f = cost.chunked_linear_attention_flops(10, 8, 4, Dv=6)  # 3 chunks, the last one padded
    assert f.sequential_steps == 3
    assert f.state == 3 * (2 * 4 * 8 * 6 + 2 * 8 * 4 * 6)
    assert f.diagonal == 3 * (2 * 4 * 8 * 4 + 2 * 4 * 4 * 6)
    assert f.scan == 3 * 8 * 6


def test_limits():
    T, D = 256, 16
    rec = cost.recurrent_linear_attention_flops(T, D)
    par = cost.parallel_linear_attention_flops(T, D)
    c1 = cost.chunked_linear_attention_flops(T, D, 1)
    cT = cost.chunked_linear_attention_flops(T, D, T)
    assert rec.state == c1.state == 4 * T * D * D and rec.diagonal == 0
    assert c1.diagonal == 4 * T * D  # q_t·k_t and its product with v_t, one token per chunk
    assert rec.sequential_steps == c1.sequential_steps == T
    assert (par.state, par.diagonal) == (cT.state, cT.diagonal)
    assert par.sequential_steps == cT.sequential_steps == 1
    assert par.diagonal == 4 * T * T * D
    assert cost.chunked_linear_attention_flops(T, D, 4 * T).diagonal == 4 * (4 * T) ** 2 * D  # padded


def test_the_fewest_matmul_flops_are_at_c_equal_1():
    counts = [cost.chunked_linear_attention_flops(1024, 64, C).matmul for C in (1, 2, 4, 16, 64, 1024)]
    assert counts == sorted(counts)


@pytest.mark.parametrize("T,C", [(64, 16), (70, 16), (64, 1), (50, 64), (64, 64)])
def test_chunked_count_equals_what_pytorch_counts(T, C):
    B, H, Dk, Dv = 2, 3, 8, 4
    q, k = torch.randn(B, H, T, Dk), torch.randn(B, H, T, Dk)
    v = torch.randn(B, H, T, Dv)
    f = cost.chunked_linear_attention_flops(T, Dk, C, Dv=Dv)
    assert _counted(la.chunked, q, k, v, chunk_size=C) == B * H * f.matmul


def test_parallel_count_equals_what_pytorch_counts():
    B, H, T, Dk, Dv = 1, 2, 40, 8, 6
    q, k, v = torch.randn(B, H, T, Dk), torch.randn(B, H, T, Dk), torch.randn(B, H, T, Dv)
    f = cost.parallel_linear_attention_flops(T, Dk, Dv=Dv)
    assert _counted(la.parallel, q, k, v) == B * H * f.matmul


def test_recurrent_read_is_what_pytorch_counts():
    """The loop's read q_t S_t is an einsum (counted); its write k_tᵀ v_t is a broadcast multiply
    and an add, which the flop counter does not see: it reports half of the model's count."""
    B, H, T, D = 1, 2, 12, 8
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    f = cost.recurrent_linear_attention_flops(T, D)
    assert 2 * _counted(la.recurrent, q, k, v) == B * H * f.state


@pytest.mark.parametrize("C, D", [(64, 128), (16, 32), (32, 64)])
def test_kda_chunk_products_cost_what_chunked_deltanet_costs(C, D):
    # two counts written separately: fla's KDA kernels' products, chapter 8's op's
    kda = cost.chunk_products("KDA", C, D)
    flops = sum(2 * m * k * n for _, m, k, n in kda) + C**3 / 3
    assert flops == pytest.approx(cost.chunked_delta_rule_flops(C, D, C), rel=1e-15)


def test_dplr_chunk_products_form_four_scores_where_kda_forms_two():
    C, D = 64, 128
    scores = {rule: [p for p in cost.chunk_products(rule, C, D) if p[1:] == (C, D, C)]
              for rule in ("DPLR", "KDA")}
    assert (len(scores["DPLR"]), len(scores["KDA"])) == (4, 2)
    assert (len(cost.chunk_products("DPLR", C, D)), len(cost.chunk_products("KDA", C, D))) == (13, 8)
    with pytest.raises(ValueError, match="rule must be"):
        cost.chunk_products("RWKV", C, D)
