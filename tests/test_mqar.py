"""tinyk3.data.mqar and recall_accuracy, and tinyk3.train.train_batches (training on MQAR)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tinyk3.data import IGNORE_INDEX, mqar, mqar_elimination_accuracy, mqar_seq_len, recall_accuracy
from tinyk3.models import MixerConfig, MixerLM
from tinyk3.train import TrainResult, train_batches

V = 64


def _pairs(inputs, n_pairs):
    """The context's key → value map of one example."""
    keys, values = inputs[0 : 2 * n_pairs : 2].tolist(), inputs[1 : 2 * n_pairs : 2].tolist()
    return dict(zip(keys, values))


# -- the generator ---------------------------------------------------------------------------

@pytest.mark.parametrize("n_pairs,n_queries", [(1, None), (4, None), (16, None), (16, 5), (32, 32)])
def test_shapes_and_layout(n_pairs, n_queries):
    x, y = mqar(50, n_pairs, V, n_queries=n_queries, seed=0)
    Q = n_pairs if n_queries is None else n_queries
    T = 2 * (n_pairs + Q) - 1
    assert T == mqar_seq_len(n_pairs, n_queries)
    assert x.shape == y.shape == (50, T)
    assert x.dtype == y.dtype == torch.long
    assert x.is_contiguous()
    ctx = x[:, : 2 * n_pairs]
    # keys from the lower half, values from the upper half of the vocabulary, alternating
    assert ctx[:, 0::2].min() >= 0 and ctx[:, 0::2].max() < V // 2
    assert ctx[:, 1::2].min() >= V // 2 and ctx[:, 1::2].max() < V
    for row_x, row_y in zip(x, y):
        keys = row_x[0 : 2 * n_pairs : 2].tolist()
        values = row_x[1 : 2 * n_pairs : 2].tolist()
        assert len(set(keys)) == n_pairs and len(set(values)) == n_pairs  # distinct within one example
        table = _pairs(row_x, n_pairs)
        queries = row_x[2 * n_pairs :: 2].tolist()  # the query keys
        assert len(queries) == Q and len(set(queries)) == Q and set(queries) <= set(keys)
        full = torch.cat([row_x, row_y[-1:]])  # the whole sequence, last token from the targets
        answers = full[2 * n_pairs + 1 :: 2].tolist()
        assert answers == [table[k] for k in queries]  # each query followed by its value


def test_targets_are_the_next_token_at_queries_only():
    n_pairs, n_queries = 8, 6
    x, y = mqar(40, n_pairs, V, n_queries=n_queries, seed=3)
    scored = y != IGNORE_INDEX
    expected = torch.zeros_like(scored)
    expected[:, 2 * n_pairs :: 2] = True  # where the input is a queried key
    assert torch.equal(scored, expected)
    assert scored.sum() == 40 * n_queries
    # a scored target is the next input token (next-token prediction) and a value
    assert torch.equal(y[:, :-1][scored[:, :-1]], x[:, 1:][scored[:, :-1]])
    assert (y[scored] >= V // 2).all()
    for row_x, row_y in zip(x, y):
        table = _pairs(row_x, n_pairs)
        for t in torch.nonzero(row_y != IGNORE_INDEX).flatten().tolist():
            assert row_y[t].item() == table[row_x[t].item()]
    assert IGNORE_INDEX == -100  # F.cross_entropy's default ignore_index


@pytest.mark.parametrize("n_queries", [None, 3])
def test_without_answers_the_queries_follow_each_other(n_queries):
    P = 6
    Q = P if n_queries is None else n_queries
    x, y = mqar(30, P, V, n_queries=n_queries, show_answers=False, seed=4)
    assert x.shape == y.shape == (30, 2 * P + Q) == (30, mqar_seq_len(P, n_queries, show_answers=False))
    shown, _ = mqar(30, P, V, n_queries=n_queries, seed=4)  # the same draws, answers shown
    assert torch.equal(x[:, : 2 * P], shown[:, : 2 * P])  # same context
    assert torch.equal(x[:, 2 * P :], shown[:, 2 * P :: 2])  # same query keys, back to back
    assert (x[:, 2 * P :] < V // 2).all()  # no value token after the context: no answers
    assert (y[:, : 2 * P] == IGNORE_INDEX).all()
    for row_x, row_y in zip(x, y):
        table = _pairs(row_x, P)
        assert row_y[2 * P :].tolist() == [table[k] for k in row_x[2 * P :].tolist()]
    with pytest.raises(TypeError, match="show_answers must be a bool"):
        mqar(2, 2, V, show_answers=0)


def test_elimination_accuracy_is_what_the_shortcut_scores():
    """Answer each query with a random context value not yet given as an answer: no recall."""
    assert mqar_elimination_accuracy(1) == 1.0
    assert math.isclose(mqar_elimination_accuracy(4), (1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    assert round(mqar_elimination_accuracy(8), 2) == 0.34 and round(mqar_elimination_accuracy(16), 2) == 0.21
    P, N = 8, 2000
    x, y = mqar(N, P, V, seed=0)
    g = torch.Generator().manual_seed(1)
    logits = torch.zeros(N, x.shape[1], V)
    for n in range(N):
        left = set(x[n, 1 : 2 * P : 2].tolist())  # the context's values
        for t in range(2 * P, x.shape[1], 2):  # at each query key
            guess = sorted(left)[torch.randint(len(left), (1,), generator=g).item()]
            logits[n, t, guess] = 1.0
            left.discard(int(x[n, t + 1]) if t + 1 < x.shape[1] else int(y[n, t]))  # the answer shown next
    assert abs(recall_accuracy(logits, y) - mqar_elimination_accuracy(P)) < 0.02
    with pytest.raises(ValueError, match="positive int"):
        mqar_elimination_accuracy(0)


def test_query_order_is_random_and_covers_all_keys():
    x, _ = mqar(200, 8, V, seed=1)
    orders = set()
    for row in x:
        keys = row[0:16:2].tolist()
        orders.add(tuple(keys.index(k) for k in row[16::2].tolist()))
    assert len(orders) > 150  # 8! = 40,320 orders: almost all distinct, not the context order
    # every key and every value token gets used across examples
    assert set(x[:, 0:16:2].flatten().tolist()) == set(range(V // 2))
    assert set(x[:, 1:16:2].flatten().tolist()) == set(range(V // 2, V))


def test_seeding():
    a = mqar(8, 4, V, seed=7)
    b = mqar(8, 4, V, seed=7)
    c = mqar(8, 4, V, seed=8)
    d = mqar(8, 4, V, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert torch.equal(a[0], d[0])  # seed=s is generator=Generator().manual_seed(s)
    g = torch.Generator().manual_seed(7)
    first, second = mqar(8, 4, V, generator=g), mqar(8, 4, V, generator=g)
    assert not torch.equal(first[0], second[0])  # a generator advances
    torch.manual_seed(3)
    e = mqar(8, 4, V)
    torch.manual_seed(3)
    assert torch.equal(e[0], mqar(8, 4, V)[0])  # neither: torch's global generator


def test_odd_vocabulary_keeps_halves_disjoint():
    x, _ = mqar(100, 5, 13, seed=0)  # keys [0, 6), values [6, 13)
    assert x[:, 0:10:2].max() < 6 and x[:, 1:10:2].min() >= 6


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(n_examples=4, n_pairs=33, vocab_size=64), ValueError, r"n_pairs=33 .*\(32 key tokens\)"),
    (dict(n_examples=4, n_pairs=4, vocab_size=7), ValueError, r"n_pairs=4 .*\(3 key tokens\)"),
    (dict(n_examples=4, n_pairs=4, vocab_size=64, n_queries=5), ValueError, "n_queries=5 > n_pairs=4"),
    (dict(n_examples=0, n_pairs=4, vocab_size=64), ValueError, "n_examples must be a positive int"),
    (dict(n_examples=4, n_pairs=0, vocab_size=64), ValueError, "n_pairs must be a positive int"),
    (dict(n_examples=4, n_pairs=2.0, vocab_size=64), ValueError, "n_pairs must be a positive int"),
    (dict(n_examples=4, n_pairs=2, vocab_size=64, n_queries=0), ValueError, "n_queries must be"),
    (dict(n_examples=True, n_pairs=2, vocab_size=64), ValueError, "n_examples must be"),
    (dict(n_examples=4, n_pairs=2, vocab_size=64, seed=1, generator=torch.Generator()), ValueError,
     "generator or seed, not both"),
])
def test_bad_arguments_are_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        mqar(**kwargs)


# -- recall accuracy ------------------------------------------------------------------------

def test_recall_accuracy_counts_scored_positions_only():
    x, y = mqar(10, 4, V, seed=0)
    logits = torch.randn(10, x.shape[1], V)
    perfect = logits.clone()
    scored = y != IGNORE_INDEX
    perfect[scored] = F.one_hot(y[scored], V).float() * 100
    assert recall_accuracy(perfect, y) == 1.0
    wrong = perfect.clone()
    wrong[scored] = -wrong[scored]
    assert recall_accuracy(wrong, y) == 0.0
    half = perfect.clone()
    half[:5][scored[:5]] = -half[:5][scored[:5]]  # the first five examples all wrong
    assert recall_accuracy(half, y) == 0.5
    # what the model predicts at unscored positions does not count
    noisy = perfect.clone()
    noisy[~scored] = torch.randn_like(noisy[~scored]) * 1e3
    assert recall_accuracy(noisy, y) == 1.0
    y2 = y.clone()
    y2[~scored] = -1
    assert recall_accuracy(perfect, y2, ignore_index=-1) == 1.0


def test_recall_accuracy_errors():
    y = torch.full((2, 3), IGNORE_INDEX)
    with pytest.raises(ValueError, match="nothing to score"):
        recall_accuracy(torch.zeros(2, 3, 5), y)
    with pytest.raises(ValueError, match=r"logits \[N, T, V\] and targets \[N, T\]"):
        recall_accuracy(torch.zeros(2, 4, 5), y)
    with pytest.raises(ValueError, match=r"logits \[N, T, V\]"):
        recall_accuracy(torch.zeros(2, 3), y)
    with pytest.raises(TypeError, match="tensors"):
        recall_accuracy([[0.0]], y)


# -- training on MQAR -------------------------------------------------------------------------

P = 4


def _tiny(mixer="softmax", seed=0):
    torch.manual_seed(seed)
    return MixerLM(MixerConfig(vocab_size=V, block_size=mqar_seq_len(P), n_layer=1, n_head=2, n_embd=16,
                               mixer=mixer))


def _batch(g):
    return mqar(16, P, V, generator=g)


def test_loss_ignores_unscored_positions():
    """One step's logged loss is the cross-entropy over the answers only, at the initial weights."""
    model = _tiny()
    x, y = _batch(torch.Generator().manual_seed(0))  # the batch the run will draw first
    with torch.no_grad():
        logits = model(x)
    scored = y != IGNORE_INDEX
    expected = F.cross_entropy(logits[scored], y[scored]).item()
    everything = F.cross_entropy(logits.flatten(0, 1), x.roll(-1, 1).flatten()).item()
    result = train_batches(model, _batch, steps=1, eval_every=1, seed=0, progress=False)
    assert math.isclose(result.train_loss[0], expected, rel_tol=1e-6)
    assert abs(result.train_loss[0] - everything) > 1e-4  # not the loss over all positions
    assert result.tokens_seen == x.numel()


@pytest.mark.parametrize("mixer", ["softmax", "linear", "deltanet"])
def test_train_batches_learns_to_answer_with_values(mixer):
    """90 steps: the model learns that an answer is one of the value tokens (loss from ln 64 ≈
    4.16 to below ln 32 ≈ 3.47), the first thing every mixer learns on MQAR."""
    model = _tiny(mixer)
    xv, yv = mqar(64, P, V, seed=99)
    calls = []

    def eval_fn(m):
        calls.append((m.training, torch.is_grad_enabled()))
        return recall_accuracy(m(xv), yv)

    modes = []  # the mode of every training forward pass, evaluations in between
    model.register_forward_pre_hook(
        lambda m, args: modes.append(m.training) if torch.is_grad_enabled() else None
    )
    result = train_batches(model, _batch, steps=90, lr=1e-2, warmup=5, eval_every=30, seed=0,
                           progress=False, eval_fn=eval_fn)
    assert modes == [True] * 90  # back in training mode after each evaluation
    assert isinstance(result, TrainResult)
    assert result.steps == result.val_steps == [30, 60, 90]
    assert calls == [(False, False)] * 3  # evaluated in eval mode, without gradients
    assert len(result.val_metric) == 3 and all(0 <= a <= 1 for a in result.val_metric)
    assert result.val_loss == []
    assert len(result.log_seconds) == 3 and result.log_seconds == sorted(result.log_seconds)
    assert result.log_seconds[-1] <= result.seconds
    assert result.train_loss[0] > result.train_loss[-1]
    assert result.train_loss[-1] < math.log(V // 2)
    assert not model.training


def test_train_batches_is_reproducible():
    runs = [train_batches(_tiny(), _batch, steps=4, eval_every=2, seed=5, progress=False).train_loss
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = train_batches(_tiny(), _batch, steps=4, eval_every=2, seed=6, progress=False).train_loss
    assert other != runs[0]


def test_train_batches_bad_arguments():
    with pytest.raises(ValueError, match="eval_every must be a positive int"):
        train_batches(_tiny(), _batch, steps=2, eval_every=0, progress=False)
    with pytest.raises(ValueError, match="steps must be a non-negative int"):
        train_batches(_tiny(), _batch, steps=-1, progress=False)
    with pytest.raises(ValueError, match="warmup must be a non-negative int"):
        train_batches(_tiny(), _batch, steps=2, warmup=True, progress=False)


# -- the experiments' sampler and held-out sets -----------------------------------------------

def test_mqar_sampler_draws_the_pair_count_then_the_batch_from_one_generator():
    from tinyk3.data import mqar_sampler

    batch = mqar_sampler(5, 8, V)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x, y = batch(g1)
    P = int(torch.randint(1, 9, (1,), generator=g2))  # what the chapters wrote out by hand
    x2, y2 = mqar(5, P, V, generator=g2, show_answers=False)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    counts = {int((batch(g1)[1] != IGNORE_INDEX).sum(1)[0]) for _ in range(60)}
    assert counts == set(range(1, 9))  # every P in 1..8, queries = pairs
    with pytest.raises(ValueError, match="do not fit"):
        mqar_sampler(2, 40, V)


def test_mqar_held_out_sets_are_fixed_and_scored_without_gradients():
    from tinyk3.data import MQARHeldOut

    held = MQARHeldOut([2, 4], 16, V)
    again = MQARHeldOut([4], 16, V)
    assert torch.equal(held.sets[4][0], again.sets[4][0])  # seed + P: the same set
    assert torch.equal(held.sets[4][0], mqar(16, 4, V, seed=1004, show_answers=False)[0])
    x, y = held.sets[2]

    class Oracle(torch.nn.Module):  # answers every query right: logits peak at the target
        def forward(self, idx):
            assert not torch.is_grad_enabled()
            return F.one_hot(y.clamp(min=0), V).float()

    assert held.accuracy(Oracle(), 2) == 1.0
    with pytest.raises(KeyError, match="no held-out set of 8 pairs"):
        held.accuracy(Oracle(), 8)


def test_mqar_curriculum_holds_then_ramps_then_stays():
    from tinyk3.data import mqar_curriculum

    batch = mqar_curriculum(4, 8, 16, 64, steps=100, hold=0.6, ramp=0.2)
    tops = [batch.top(s) for s in range(100)]
    assert set(tops[:61]) == {8} and tops[80:] == [16] * 20
    assert tops[60:81] == sorted(tops[60:81]) and len(set(tops[60:81])) > 5  # a ramp
    g = torch.Generator().manual_seed(0)
    seen = []
    for _ in range(100):
        x, y = batch(g)
        seen.append((x.shape[1] + 1) // 3)  # T = 2P + P - 1 without answers shown
    assert max(seen[:60]) <= 8 and max(seen[80:]) > 8 and max(seen) <= 16
    with pytest.raises(ValueError, match="start_pairs <= max_pairs"):
        mqar_curriculum(4, 20, 16, 64, steps=10)
    with pytest.raises(ValueError, match="hold"):
        mqar_curriculum(4, 8, 16, 64, steps=10, hold=0.9, ramp=0.2)
