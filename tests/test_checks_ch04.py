"""Chapter 4's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers import assert_failed, right, wrong
from tinyk3 import checks

# -- memory.write_memory ------------------------------------------------------------------------


@wrong("memory.write_memory", "transposed")
def wm_papers_layout(keys, values):
    S = torch.zeros(values.shape[1], keys.shape[1], dtype=keys.dtype)
    for j in range(keys.shape[0]):
        S += torch.outer(values[j], keys[j])  # v_j k_jᵀ, as in the papers
    return S


@wrong("memory.write_memory", "mean")
def wm_einsum_mean(keys, values):
    return torch.einsum("nk,nv->kv", keys, values) / len(keys)


@wrong("memory.write_memory", "last_pair_only")
def wm_loop_overwrites(keys, values):
    for j in range(keys.shape[0]):
        S = keys[j].unsqueeze(1) @ values[j].unsqueeze(0)  # forgot the +=
    return S


@wrong("memory.write_memory", "outer_of_sums")
def wm_sum_then_outer(keys, values):
    return keys.sum(dim=0)[:, None] * values.sum(dim=0)[None, :]


@wrong("memory.write_memory")
def wm_elementwise(keys, values):
    return (keys * values).sum(dim=0)  # [D]: a vector, not a matrix (and crashes if Dk ≠ Dv)


def wm_float32_buffer(keys, values):
    S = torch.zeros(keys.shape[1], values.shape[1])  # float32 whatever the inputs
    for k, v in zip(keys, values):
        S += torch.outer(k, v)
    return S


@right("memory.write_memory")
def wm_ok_loop(keys, values):
    S = torch.zeros(keys.shape[1], values.shape[1], dtype=keys.dtype)
    for k, v in zip(keys, values):
        S = S + k[:, None] * v[None, :]
    return S


@right("memory.write_memory")
def wm_ok_einsum(keys, values):
    return torch.einsum("nk,nv->kv", keys, values)


@right("memory.write_memory")
def wm_ok_broadcast_sum(keys, values):
    return (keys.unsqueeze(2) * values.unsqueeze(1)).sum(dim=0)


# -- memory.recall_accuracy ---------------------------------------------------------------------


@wrong("memory.recall_accuracy", "wrong_axis")
def ra_argmax_over_reads(S, keys, values):
    reads = keys @ S
    sims = F.normalize(reads, dim=1) @ F.normalize(values, dim=1).T
    return (sims.argmax(dim=0) == torch.arange(len(keys))).float().mean().item()


@wrong("memory.recall_accuracy", "dot_not_cosine")
def ra_dot_product(S, keys, values):
    scores = (keys @ S) @ values.T
    return (scores.argmax(dim=1) == torch.arange(len(keys))).float().mean().item()


@wrong("memory.recall_accuracy", "rewrites_state")
def ra_builds_its_own_state(S, keys, values):
    S = keys.T @ values  # "to be safe"
    reads = keys @ S
    sims = F.cosine_similarity(reads[:, None, :], values[None, :, :], dim=-1)
    return (sims.argmax(dim=1) == torch.arange(len(keys))).float().mean().item()


@wrong("memory.recall_accuracy", "count_not_fraction")
def ra_returns_count(S, keys, values):
    reads = keys @ S
    sims = F.cosine_similarity(reads[:, None, :], values[None, :, :], dim=-1)
    return int((sims.argmax(dim=1) == torch.arange(len(keys))).sum())


@wrong("memory.recall_accuracy", "against_keys")
def ra_compares_with_keys(S, keys, values):
    reads = keys @ S
    sims = F.cosine_similarity(reads[:, None, :], keys[None, :, :], dim=-1)  # crashes if Dk ≠ Dv
    return (sims.argmax(dim=1) == torch.arange(len(keys))).float().mean().item()


@wrong("memory.recall_accuracy")
def ra_euclidean(S, keys, values):
    dist = torch.cdist(keys @ S, values)  # nearest in distance, not in angle
    return (dist.argmin(dim=1) == torch.arange(len(keys))).float().mean().item()


@right("memory.recall_accuracy")
def ra_ok_loop(S, keys, values):
    correct = 0
    for i in range(len(keys)):
        r = keys[i] @ S
        cos = torch.stack([r @ v / (r.norm() * v.norm()) for v in values])
        correct += int(cos.argmax() == i)
    return correct / len(keys)


@right("memory.recall_accuracy")
def ra_ok_broadcast(S, keys, values):
    sims = F.cosine_similarity((keys @ S).unsqueeze(1), values.unsqueeze(0), dim=-1)  # [N, N]
    return (sims.argmax(-1) == torch.arange(keys.shape[0])).double().mean()  # a 0-d tensor


# -- memory.crosstalk_std -----------------------------------------------------------------------


@wrong("memory.crosstalk_std", "with_diagonal")
def ct_whole_gram(keys):
    G = keys @ keys.T
    return (G**2).sum(dim=1).sqrt()


@wrong("memory.crosstalk_std", "no_sqrt")
def ct_variance(keys):
    G = keys @ keys.T
    G.fill_diagonal_(0)
    return (G**2).sum(dim=-1)


@wrong("memory.crosstalk_std", "stds_added")
def ct_adds_abs_values(keys):
    G = keys @ keys.T
    return (G - torch.diag(torch.diag(G))).abs().sum(dim=1)


@wrong("memory.crosstalk_std", "random_key_formula")
def ct_average_formula(keys):
    N, D = keys.shape
    return torch.full((N,), ((N - 1) / D) ** 0.5)


@wrong("memory.crosstalk_std")
def ct_assumes_unit_keys(keys):
    G = keys @ keys.T
    return ((G**2).sum(dim=1) - 1).sqrt()  # the diagonal is 1 only for unit keys


@right("memory.crosstalk_std")
def ct_ok_masked(keys):
    G = keys @ keys.T
    off = ~torch.eye(len(keys), dtype=torch.bool)
    return torch.where(off, G, torch.zeros_like(G)).pow(2).sum(-1).sqrt()


@right("memory.crosstalk_std")
def ct_ok_loop(keys):
    out = torch.zeros(len(keys), dtype=keys.dtype)
    for i in range(len(keys)):
        total = 0.0
        for j in range(len(keys)):
            if j != i:
                total = total + (keys[i] @ keys[j]) ** 2
        out[i] = torch.as_tensor(total).sqrt()
    return out


def test_float32_buffer_fails_only_the_float64_case():
    result = checks.run("memory.write_memory", wm_float32_buffer, verbose=False)
    assert_failed(result, None)
    assert result.n_passed == result.n_cases - 1 == result.failed_case - 1
    assert "wrong dtype: expected torch.float64, got torch.float32" in result.report


def test_assuming_unit_keys_fails_first_on_the_non_unit_case():
    """Subtracting 1 for the diagonal is right for unit keys only: cases 1-2 pass, case 3
    (keys not of unit length) is the first failure."""
    result = checks.run("memory.crosstalk_std", ct_assumes_unit_keys, verbose=False)
    assert_failed(result, None)
    assert result.failed_case == 3
    assert "(keys not of unit length)" in result.report
