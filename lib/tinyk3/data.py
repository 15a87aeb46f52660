"""Offline data: English prose that ships with every Python, tokenised as bytes; and MQAR.

``pydoc_data.topics`` holds the text of Python's ``help()`` topics (about 465 KB of
documentation prose and code). It is present in every CPython, Colab's included, so nothing
is downloaded. Bytes are the tokens: vocabulary 256, no tokenizer to train.

:func:`mqar` generates multi-query associative recall (Arora et al., "Zoology", ICLR 2024),
the synthetic task that probes how many key-value pairs a fixed-size state can recall
(chapters 4, 5 and 15); :func:`recall_accuracy` scores a model on it.
"""

from __future__ import annotations

import torch

from ._validate import positive_int

__all__ = [
    "load_corpus", "encode", "decode", "split", "get_batch", "VOCAB_SIZE",
    "IGNORE_INDEX", "unigram_entropy", "mqar", "mqar_seq_len", "mqar_elimination_accuracy", "recall_accuracy",
    "mqar_sampler", "mqar_curriculum", "MQARHeldOut",
]

VOCAB_SIZE = 256


def load_corpus() -> bytes:
    """The help-topic texts, in a fixed (sorted) order, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def encode(text: str | bytes) -> torch.Tensor:
    """Text → ``int64`` tensor of byte values."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.tensor(list(data), dtype=torch.long)


def decode(tokens) -> str:
    """Byte values → text (invalid UTF-8, e.g. a half-sampled character, shows as �)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def split(data: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """First ``1 - val_fraction`` for training, the rest for validation (no shuffling)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n = int(len(data) * (1 - val_fraction))
    return data[:n], data[n:]


def unigram_entropy(tokens: torch.Tensor, vocab_size: int = VOCAB_SIZE) -> float:
    """The loss, in nats per token, of predicting every token from the frequencies of
    ``tokens`` alone, with no context: the entropy ``-Σ p log p`` of those frequencies.
    Chapter 1's baseline, the line every trained model must go below."""
    if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point \
            or tokens.dtype == torch.bool or tokens.dim() != 1 or tokens.numel() == 0:
        raise ValueError("unigram_entropy: tokens must be a non-empty 1-D tensor of integer "
                         f"ids, got {getattr(tokens, 'dtype', type(tokens).__name__)} "
                         f"{list(getattr(tokens, 'shape', []))}")
    vocab_size = positive_int(vocab_size, "vocab_size", "unigram_entropy")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"unigram_entropy: ids must lie in [0, {vocab_size}), got "
                         f"{int(tokens.min())} to {int(tokens.max())}")
    freq = torch.bincount(tokens.cpu(), minlength=vocab_size).double() / tokens.numel()
    freq = freq[freq > 0]
    return -(freq * freq.log()).sum().item()


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs ``x [B, T]`` and next-token targets ``y [B, T]`` (shifted by one)."""
    batch_size = positive_int(batch_size, "batch_size", "get_batch")
    block_size = positive_int(block_size, "block_size", "get_batch")
    if len(data) <= block_size:
        raise ValueError(f"data has {len(data)} tokens, need more than block_size={block_size}")
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[s : s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + block_size] for s in starts.tolist()])
    return x, y


# -- multi-query associative recall (MQAR) -----------------------------------------------

IGNORE_INDEX = -100  # targets with this value carry no loss (F.cross_entropy's default)


def mqar_seq_len(n_pairs: int, n_queries: int | None = None, show_answers: bool = True) -> int:
    """Length ``T`` of an :func:`mqar` example: ``2·(P + Q) − 1``, or ``2·P + Q`` without answers."""
    n_queries = n_pairs if n_queries is None else n_queries
    return 2 * (n_pairs + n_queries) - 1 if show_answers else 2 * n_pairs + n_queries


def mqar_elimination_accuracy(n_queries: int) -> float:
    """Recall accuracy reachable *without* recall when the answers are shown (the default).

    Once queries ``1..j`` have been answered in the input, a model that answers query ``j+1``
    with any context value not yet seen as an answer is right with probability ``1/(Q − j)``
    (with ``Q = P``); averaged over the queries: ``H_Q / Q`` (``H`` the harmonic number), e.g.
    52 % for 4 queries, 34 % for 8, 21 % for 16. Accuracy above this needs associative recall;
    ``show_answers=False`` removes the shortcut (chance is then ``1/P``).
    """
    n_queries = positive_int(n_queries, "n_queries", "mqar_elimination_accuracy")
    return sum(1.0 / i for i in range(1, n_queries + 1)) / n_queries


def mqar(
    n_examples: int,
    n_pairs: int,
    vocab_size: int,
    *,
    n_queries: int | None = None,
    show_answers: bool = True,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query associative recall examples: ``(inputs [N, T], targets [N, T])``, int64.

    Each example is a context of ``n_pairs`` key-value pairs, then ``n_queries`` of those keys
    again (distinct, in random order), each followed by its value::

        k_1 v_1 k_2 v_2 … k_P v_P | k_a v_a k_b v_b …        (a, b, … a permutation of 1..P)

    Keys are drawn from the lower half of the vocabulary, ``[0, V//2)``, values from the upper
    half, ``[V//2, V)``, both without replacement within an example (distinct keys, so every
    query has one right answer). ``inputs`` is the sequence without its last token and
    ``targets`` the sequence shifted by one (next-token prediction), with every target set to
    ``IGNORE_INDEX`` (-100) except where the input is a queried key and the next token is its
    value: the loss and :func:`recall_accuracy` count recall only. ``T = 2·(P + Q) − 1``.

    Showing the answers lets a model score without recall when every key is queried: answer
    with a context value not yet given as an answer (:func:`mqar_elimination_accuracy`,
    34 % for 8 pairs). With ``show_answers=False`` the queries follow each other with no
    answers in between, ``k_1 v_1 … k_P v_P | k_a k_b …``, and the target at each query is
    its value (no longer the next input token), as in Zoology; ``T = 2·P + Q``.

    Source: Arora et al., "Zoology: Measuring and Improving Recall in Efficient Language
    Models" (ICLR 2024), and their ``zoology/data/multiquery_ar.py``. Differences: Zoology
    draws keys from ``[1, V//2)``, scatters the queries at power-law distributed gaps among
    random filler tokens and does not show the answers in the input; here the queries follow
    the context back to back, each followed by its answer, so nothing is filler.

    Randomness: pass ``generator`` (a ``torch.Generator``) or ``seed`` (an int), not both;
    with neither, torch's global generator is used. The same seed gives the same examples.
    """
    n_queries = n_pairs if n_queries is None else n_queries
    if not isinstance(show_answers, bool):
        raise TypeError(f"mqar: show_answers must be a bool, got {show_answers!r}")
    for name, value in (("n_examples", n_examples), ("n_pairs", n_pairs), ("vocab_size", vocab_size),
                        ("n_queries", n_queries)):
        positive_int(value, name, "mqar")
    n_keys = vocab_size // 2  # keys [0, V//2), values [V//2, V): n_keys <= n_values
    if n_pairs > n_keys:
        raise ValueError(
            f"mqar: n_pairs={n_pairs} distinct keys do not fit in half of vocab_size={vocab_size} "
            f"({n_keys} key tokens); use n_pairs <= {n_keys} or a larger vocabulary"
        )
    if n_queries > n_pairs:
        raise ValueError(
            f"mqar: n_queries={n_queries} > n_pairs={n_pairs}: each query repeats a distinct key"
        )
    if generator is not None and seed is not None:
        raise ValueError("mqar: pass generator or seed, not both")
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    N, P, Q = n_examples, n_pairs, n_queries

    # Distinct draws per row: the first P of a random permutation of each half.
    keys = torch.rand(N, n_keys, generator=generator).argsort(dim=1)[:, :P]  # [N, P]
    n_values = vocab_size - n_keys
    values = n_keys + torch.rand(N, n_values, generator=generator).argsort(dim=1)[:, :P]  # [N, P]
    order = torch.rand(N, P, generator=generator).argsort(dim=1)[:, :Q]  # which pairs, in what order [N, Q]
    q_keys = keys.gather(1, order)  # [N, Q]
    q_values = values.gather(1, order)  # [N, Q]

    if not show_answers:  # k v … k v | k k …: the target at each query key is its value
        inputs = torch.empty(N, 2 * P + Q, dtype=torch.long)  # [N, T]
        inputs[:, 0 : 2 * P : 2], inputs[:, 1 : 2 * P : 2] = keys, values  # context
        inputs[:, 2 * P :] = q_keys  # queries
        targets = torch.full_like(inputs, IGNORE_INDEX)  # [N, T]
        targets[:, 2 * P :] = q_values
        return inputs, targets

    seq = torch.empty(N, 2 * (P + Q), dtype=torch.long)  # [N, T + 1]
    seq[:, 0 : 2 * P : 2], seq[:, 1 : 2 * P : 2] = keys, values  # context: k v k v …
    seq[:, 2 * P :: 2], seq[:, 2 * P + 1 :: 2] = q_keys, q_values  # queries: k v k v …
    inputs, targets = seq[:, :-1], seq[:, 1:].clone()  # [N, T] each
    recall = torch.zeros_like(targets, dtype=torch.bool)  # [N, T]
    recall[:, 2 * P :: 2] = True  # input is a queried key, target its value
    targets[~recall] = IGNORE_INDEX
    return inputs.contiguous(), targets


def mqar_sampler(batch_size: int, max_pairs: int, vocab_size: int, *,
                 show_answers: bool = False):
    """A batch function for :func:`tinyk3.train.train_batches`: each call ``batch(g)`` draws
    one pair count ``P ~ U{1, ..., max_pairs}`` from the generator ``g``, then
    ``mqar(batch_size, P, vocab_size)`` from the same generator (the training data of the
    recall experiments of chapters 5, 15 and 18)."""
    for name, value in (("batch_size", batch_size), ("max_pairs", max_pairs),
                        ("vocab_size", vocab_size)):
        positive_int(value, name, "mqar_sampler")
    if max_pairs > vocab_size // 2:
        raise ValueError(f"mqar_sampler: max_pairs={max_pairs} keys do not fit in half of "
                         f"vocab_size={vocab_size}")

    def batch(g: torch.Generator):
        P = int(torch.randint(1, max_pairs + 1, (1,), generator=g))  # one count per batch
        return mqar(batch_size, P, vocab_size, generator=g, show_answers=show_answers)

    return batch


def mqar_curriculum(batch_size: int, start_pairs: int, max_pairs: int, vocab_size: int,
                    steps: int, *, hold: float = 0.6, ramp: float = 0.2):
    """A batch function like :func:`mqar_sampler` whose largest pair count grows: ``P ~ U{1,
    ..., top}`` with ``top = start_pairs`` for the first ``hold`` of the ``steps`` calls, then
    rising linearly to ``max_pairs`` over the next ``ramp`` of them, and ``max_pairs`` after
    (chapter 15: a model first learns recall at few pairs, then meets more pairs than its
    state holds). ``batch.top(step)`` gives the schedule; each call advances it by one."""
    op = "mqar_curriculum"
    for name, value in (("batch_size", batch_size), ("start_pairs", start_pairs),
                        ("max_pairs", max_pairs), ("vocab_size", vocab_size), ("steps", steps)):
        positive_int(value, name, op)
    if not start_pairs <= max_pairs <= vocab_size // 2:
        raise ValueError(f"{op}: need start_pairs <= max_pairs <= vocab_size // 2, got "
                         f"{start_pairs}, {max_pairs}, {vocab_size}")
    if not (0 <= hold and 0 < ramp and hold + ramp <= 1):
        raise ValueError(f"{op}: need hold >= 0, ramp > 0 and hold + ramp <= 1, got "
                         f"{hold}, {ramp}")
    calls = [0]

    def top(step: int) -> int:
        frac = min(1.0, max(0.0, (step - hold * steps) / (ramp * steps)))
        return round(start_pairs + (max_pairs - start_pairs) * frac)

    def batch(g: torch.Generator):
        P = int(torch.randint(1, top(calls[0]) + 1, (1,), generator=g))
        calls[0] += 1
        return mqar(batch_size, P, vocab_size, generator=g, show_answers=False)

    batch.top = top
    return batch


class MQARHeldOut:
    """Fixed held-out recall sets, one per pair count: ``mqar(n_examples, P, vocab_size,
    seed=seed + P)`` for each ``P`` in ``pairs``; ``accuracy(model, P)`` is the model's
    :func:`recall_accuracy` on the set of ``P`` pairs (without gradients)."""

    def __init__(self, pairs, n_examples: int, vocab_size: int, *, show_answers: bool = False,
                 seed: int = 1000):
        self.pairs = tuple(pairs)
        if not self.pairs:
            raise ValueError("MQARHeldOut: give at least one pair count")
        self.sets = {P: mqar(n_examples, P, vocab_size, seed=seed + P, show_answers=show_answers)
                     for P in self.pairs}

    def accuracy(self, model, n_pairs: int) -> float:
        if n_pairs not in self.sets:
            raise KeyError(f"MQARHeldOut: no held-out set of {n_pairs} pairs "
                           f"(have {list(self.pairs)})")
        x, y = self.sets[n_pairs]
        with torch.no_grad():
            return recall_accuracy(model(x), y)


def recall_accuracy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> float:
    """Fraction of scored positions (``targets != ignore_index``) where ``argmax(logits)`` is the target.

    ``logits: [N, T, V]``, ``targets: [N, T]``. For :func:`mqar` data this is the fraction of
    queries answered with the right value (chance is about ``1 / (V/2)`` once the model has
    learned to answer with a value token).
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError("recall_accuracy: logits and targets must be tensors")
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"recall_accuracy: expected logits [N, T, V] and targets [N, T], got "
            f"{tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    scored = targets != ignore_index  # [N, T]
    if not scored.any():
        raise ValueError(f"recall_accuracy: every target is ignore_index={ignore_index}: nothing to score")
    correct = logits.argmax(dim=-1) == targets  # [N, T]
    return correct[scored].float().mean().item()
