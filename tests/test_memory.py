"""tinyk3.memory: the write forms agree with each other and with linear attention's state, reads
and scores agree with explicit loops written here, the key sets have the properties claimed, and
the crosstalk formulas match Monte Carlo measurements."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tinyk3 import memory
from tinyk3.ops import linear_attention


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# -- write and read ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 4, 4), (7, 5, 3), (20, 8, 8), (2, 3, 9, 6, 2)],
                         ids=["single", "Dk>Dv", "N>D", "batched"])
def test_write_loop_equals_write(shape):
    *lead, N, Dk, Dv = shape
    g = _gen()
    k = torch.randn(*lead, N, Dk, generator=g, dtype=torch.float64)
    v = torch.randn(*lead, N, Dv, generator=g, dtype=torch.float64)
    assert torch.allclose(memory.write_loop(k, v), memory.write(k, v), rtol=0, atol=1e-12)
    assert memory.write(k, v).shape == (*lead, Dk, Dv)


def test_write_is_the_linear_attention_state():
    """The memory of N pairs is the state after N tokens of (unnormalised) linear attention."""
    g = _gen(1)
    B, H, T, Dk, Dv = 2, 3, 11, 6, 5
    q, k = (torch.randn(B, H, T, Dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64)
    _, S = linear_attention.recurrent(q, k, v)
    assert torch.allclose(memory.write(k, v), S, rtol=0, atol=1e-12)
    # and reading with the final state is linear attention's output at the last token
    o, _ = linear_attention.recurrent(q, k, v)
    assert torch.allclose(memory.read(S, q[:, :, -1:]), o[:, :, -1:], rtol=0, atol=1e-12)


def test_read_is_value_plus_crosstalk():
    g = _gen(2)
    N, Dk, Dv = 9, 4, 3
    k = torch.randn(N, Dk, generator=g, dtype=torch.float64)
    v = torch.randn(N, Dv, generator=g, dtype=torch.float64)
    reads = memory.read(memory.write(k, v), k)
    for i in range(N):
        expected = (k[i] @ k[i]) * v[i] + sum((k[i] @ k[j]) * v[j] for j in range(N) if j != i)
        assert torch.allclose(reads[i], expected, rtol=0, atol=1e-12)


def test_shape_errors_are_clear():
    k, v = torch.randn(5, 4), torch.randn(6, 4)
    with pytest.raises(ValueError, match="must agree"):
        memory.write(k, v)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        memory.write(torch.randn(4), torch.randn(4))
    with pytest.raises(TypeError, match="one dtype"):
        memory.write(torch.randn(5, 4), torch.randn(5, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="Dk = 4"):
        memory.read(torch.randn(3, 3), torch.randn(5, 4))


# -- scoring ------------------------------------------------------------------------------------

def _accuracy_loop(S, keys, values):
    hits = 0
    for i in range(keys.shape[0]):
        r = keys[i] @ S
        cos = [float(F.cosine_similarity(r, values[j], dim=0)) for j in range(values.shape[0])]
        hits += int(max(range(len(cos)), key=cos.__getitem__) == i)
    return hits / keys.shape[0]


@pytest.mark.parametrize("N,D", [(8, 16), (32, 16), (64, 16), (20, 8)])
def test_recall_accuracy_equals_a_loop(N, D):
    g = _gen(N + D)
    k = memory.random_unit_keys(N, D, generator=g, dtype=torch.float64)
    v = torch.randn(N, D, generator=g, dtype=torch.float64) * torch.rand(N, 1, generator=g) * 3
    S = memory.write(k, v)
    assert memory.recall_accuracy(S, k, v) == _accuracy_loop(S, k, v)


def test_recall_accuracy_batched_is_the_mean():
    g = _gen(3)
    k = memory.random_unit_keys(4 * 24, 12, generator=g).view(4, 24, 12)
    v = torch.randn(4, 24, 12, generator=g)
    S = memory.write(k, v)
    per = [memory.recall_accuracy(S[b], k[b], v[b]) for b in range(4)]
    assert memory.recall_accuracy(S, k, v) == pytest.approx(sum(per) / 4, abs=1e-12)


def test_relative_error_definition_and_scale():
    g = _gen(4)
    k = torch.randn(10, 6, generator=g, dtype=torch.float64)
    v = torch.randn(10, 3, generator=g, dtype=torch.float64)
    S = memory.write(k, v)
    err = ((k @ S - v).norm() / v.norm()).item()
    assert memory.relative_error(S, k, v) == pytest.approx(err, rel=1e-12)
    # accuracy ignores the scale of S (cosine), the error does not
    assert memory.recall_accuracy(3.0 * S, k, v) == memory.recall_accuracy(S, k, v)


# -- key sets -----------------------------------------------------------------------------------

@pytest.mark.parametrize("N,D", [(1, 1), (5, 8), (16, 16)])
def test_orthonormal_keys_recall_exactly(N, D):
    k = memory.orthonormal_keys(N, D, generator=_gen(5), dtype=torch.float64)
    assert torch.allclose(k @ k.T, torch.eye(N, dtype=torch.float64), rtol=0, atol=1e-12)
    v = torch.randn(N, 7, generator=_gen(6), dtype=torch.float64)
    S = memory.write(k, v)
    assert memory.relative_error(S, k, v) < 1e-12
    assert memory.recall_accuracy(S, k, v) == 1.0
    assert memory.crosstalk_std(k).max().item() < 1e-12


def test_orthonormal_keys_refuse_more_than_d():
    with pytest.raises(ValueError, match="at most D = 4"):
        memory.orthonormal_keys(5, 4)


def test_random_unit_keys_are_unit_and_seeded():
    a = memory.random_unit_keys(50, 7, generator=_gen(7))
    b = memory.random_unit_keys(50, 7, generator=_gen(7))
    assert torch.equal(a, b)
    assert torch.allclose(a.norm(dim=-1), torch.ones(50), atol=1e-6)


@pytest.mark.parametrize("N,D", [(10, 8), (33, 16), (256, 32)])
def test_harmonic_frame_is_a_unit_tight_frame_at_the_welch_bound(N, D):
    k = memory.harmonic_frame(N, D, dtype=torch.float64)
    assert k.shape == (N, D)
    assert torch.allclose(k.norm(dim=-1), torch.ones(N, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(k.T @ k, (N / D) * torch.eye(D, dtype=torch.float64), atol=1e-10)
    ct = memory.crosstalk_std(k)
    assert torch.allclose(ct, torch.full((N,), memory.min_crosstalk_std(N, D),
                                         dtype=torch.float64), atol=1e-10)


def test_harmonic_frame_needs_even_d_and_more_keys_than_d():
    for N, D in [(8, 8), (10, 7), (4, 8)]:
        with pytest.raises(ValueError, match="even D and N > D"):
            memory.harmonic_frame(N, D)


def test_no_unit_keys_beat_the_welch_bound():
    """Random, orthonormal and frame keys: mean crosstalk variance ≥ N/D − 1."""
    g = _gen(8)
    for N, D in [(8, 8), (20, 8), (64, 16)]:
        for k in (memory.random_unit_keys(N, D, generator=g, dtype=torch.float64),
                  F.normalize(torch.rand(N, D, generator=g, dtype=torch.float64), dim=-1)):
            var = memory.crosstalk_std(k).pow(2).mean().item()
            assert var >= memory.min_crosstalk_std(N, D) ** 2 - 1e-12


# -- crosstalk formulas against measurement -----------------------------------------------------

def test_crosstalk_std_equals_a_loop():
    g = _gen(9)
    k = torch.randn(7, 5, generator=g, dtype=torch.float64)
    want = torch.tensor([math.sqrt(sum(float(k[i] @ k[j]) ** 2 for j in range(7) if j != i))
                         for i in range(7)], dtype=torch.float64)
    assert torch.allclose(memory.crosstalk_std(k), want, rtol=1e-12, atol=0)
    assert memory.crosstalk_std(k.expand(3, 7, 5)).shape == (3, 7)


@pytest.mark.parametrize("N,D", [(2, 16), (16, 16), (64, 16), (128, 64)])
def test_random_key_crosstalk_matches_measurement(N, D):
    """Monte Carlo over many memories: measured error² and mean crosstalk_std² ≈ (N−1)/D.
    (With few pairs each (k_i·k_j)² is a heavy-tailed sample: more memories for small N.)"""
    g = _gen(N * D)
    M = max(200, 20000 // N)
    k = memory.random_unit_keys(M * N, D, generator=g, dtype=torch.float64).view(M, N, D)
    v = torch.randn(M, N, D, generator=g, dtype=torch.float64)
    S = memory.write(k, v)
    predicted = memory.random_key_crosstalk_std(N, D) ** 2
    assert memory.relative_error(S, k, v) ** 2 == pytest.approx(predicted, rel=0.06)
    assert memory.crosstalk_std(k).pow(2).mean().item() == pytest.approx(predicted, rel=0.06)


def test_crosstalk_std_predicts_the_error_for_positive_keys_too():
    """ELU+1 keys (all dot products positive): the per-key formula still predicts the error."""
    g = _gen(10)
    x = torch.randn(300, 32, 16, generator=g, dtype=torch.float64)
    k = F.normalize(F.elu(x) + 1, dim=-1)
    v = torch.randn(300, 32, 16, generator=g, dtype=torch.float64)
    measured = memory.relative_error(memory.write(k, v), k, v) ** 2
    assert measured == pytest.approx(memory.crosstalk_std(k).pow(2).mean().item(), rel=0.05)
    assert measured > 5 * memory.random_key_crosstalk_std(32, 16) ** 2


def test_formulas_on_edge_cases():
    assert memory.random_key_crosstalk_std(1, 8) == 0.0
    assert memory.min_crosstalk_std(8, 8) == 0.0 and memory.min_crosstalk_std(3, 8) == 0.0
    assert memory.min_crosstalk_std(24, 8) == pytest.approx(math.sqrt(2))
    with pytest.raises(ValueError, match="positive ints"):
        memory.random_key_crosstalk_std(0, 8)


def test_two_time_scales_puts_each_lifetime_in_its_own_channels():
    from tinyk3.memory import two_time_scales

    task = two_time_scales(3, 40, seed=5, n_long=8, Dk=16, Dv=4, max_lag=3)
    q, k, v, src, at, n_long = task
    assert q.shape == k.shape == (3, 1, 48, 16) and v.shape == (3, 1, 48, 4) and n_long == 8
    long, stream = k[:, 0, :8], k[:, 0, 8:]
    eye = torch.eye(8, dtype=torch.float64).expand(3, 8, 8)
    assert torch.allclose(long[..., :8] @ long[..., :8].mT, eye, atol=1e-12)
    assert long[..., 8:].abs().max() == 0 and stream[..., :8].abs().max() == 0
    assert torch.allclose(stream.norm(dim=-1), torch.ones(3, 40, dtype=torch.float64))
    assert torch.allclose(v.norm(dim=-1), torch.ones(3, 1, 48, dtype=torch.float64))
    lag = at - src
    assert ((lag >= 1) & (lag <= 3)).all() and (src >= 8).all()
    assert torch.equal(q[:, 0, at], k[:, 0, src])  # each scored query is an earlier key
    again = two_time_scales(3, 40, seed=5, n_long=8, Dk=16, Dv=4, max_lag=3)
    assert all(torch.equal(a, b) for a, b in zip(task[:5], again[:5]))
    with pytest.raises(ValueError, match="fewer channels"):
        two_time_scales(1, 4, seed=0, n_long=16, Dk=16)
