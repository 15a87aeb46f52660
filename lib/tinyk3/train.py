"""A small, honest training loop for the course's CPU experiments.

:func:`train_lm` trains on windows of a token stream; :func:`train_batches` on any batch
function (e.g. MQAR, whose targets are ``-100`` except at the answers). One loop serves both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ._validate import nonnegative_int, positive_int
from .data import IGNORE_INDEX, get_batch

__all__ = ["TrainResult", "train_lm", "train_batches", "evaluate_loss"]


@dataclass
class TrainResult:
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)  # running mean over each interval
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens_seen: int = 0
    log_seconds: list[float] = field(default_factory=list)  # wall time at each of steps (evals included)
    val_metric: list[float] = field(default_factory=list)  # train_batches' eval_fn, at val_steps


@torch.no_grad()
def evaluate_loss(model, data, batch_size, block_size, n_batches=8, seed=1234) -> float:
    """Mean cross-entropy on ``n_batches`` fixed random windows of ``data``."""
    was_training = model.training
    model.eval()
    try:
        g = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(n_batches):
            x, y = get_batch(data, batch_size, block_size, g)
            logits = model(x)
            losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


def train_lm(
    model,
    train_data: torch.Tensor,
    val_data: torch.Tensor | None = None,
    *,
    steps: int,
    batch_size: int = 32,
    block_size: int | None = None,
    lr: float = 3e-3,
    warmup: int = 20,
    eval_every: int = 50,
    seed: int = 0,
    progress: bool = True,
) -> TrainResult:
    """Next-token training with AdamW, linear warm-up then cosine decay to 10 % of ``lr``.

    Batches are random windows of ``train_data`` (:func:`tinyk3.data.get_batch`); at every
    log point the loss on fixed windows of ``val_data`` goes to ``result.val_loss``. The loop
    itself is :func:`train_batches`'s.
    """
    batch_size = positive_int(batch_size, "batch_size", "train_lm")
    block_size = (model.config.block_size if block_size is None
                  else positive_int(block_size, "block_size", "train_lm"))

    def batch_fn(g: torch.Generator):
        return get_batch(train_data, batch_size, block_size, g)

    def log_val(result: TrainResult) -> None:
        result.val_loss.append(evaluate_loss(model, val_data, batch_size, block_size))

    return _fit(model, batch_fn, steps=steps, lr=lr, warmup=warmup, eval_every=eval_every,
                seed=seed, progress=progress, log_eval=None if val_data is None else log_val)


def train_batches(
    model,
    batch_fn: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    lr: float = 3e-3,
    warmup: int = 20,
    eval_every: int = 50,
    seed: int = 0,
    progress: bool = True,
    eval_fn: Callable[[torch.nn.Module], float] | None = None,
) -> TrainResult:
    """:func:`train_lm`'s loop on batches from ``batch_fn(generator) -> (x [B, T], y [B, T])``.

    ``y`` holds next-token targets; positions with ``y == -100`` carry no loss (``ignore_index``
    of ``F.cross_entropy``), so a task such as MQAR (:func:`tinyk3.data.mqar`) is trained on
    its answers only. ``batch_fn`` gets one ``torch.Generator`` seeded with ``seed`` and must
    draw all its randomness from it: the run is then reproducible. At every log point (each
    ``eval_every`` steps and the last) ``eval_fn(model)``, if given, is called in eval mode
    without gradients, and its value stored in ``result.val_metric`` (e.g. recall accuracy on
    held-out examples). Same optimiser and schedule as :func:`train_lm`.
    """
    if eval_fn is None:
        log_eval = None
    else:
        def log_eval(result: TrainResult) -> None:
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    result.val_metric.append(float(eval_fn(model)))
            finally:
                model.train(was_training)

    return _fit(model, batch_fn, steps=steps, lr=lr, warmup=warmup, eval_every=eval_every,
                seed=seed, progress=progress, log_eval=log_eval)


def _fit(model, batch_fn, *, steps, lr, warmup, eval_every, seed, progress, log_eval) -> TrainResult:
    """The loop shared by :func:`train_lm` and :func:`train_batches`.

    AdamW (β = 0.9, 0.95; weight decay 0.1), gradient norm clipped at 1, linear warm-up over
    ``warmup`` steps then cosine decay to 10 % of ``lr``. ``log_eval(result)``, if given, runs
    at each log point and appends to the result.
    """
    from tqdm.auto import tqdm

    steps = nonnegative_int(steps, "steps", "train")
    eval_every = positive_int(eval_every, "eval_every", "train")
    warmup = nonnegative_int(warmup, "warmup", "train")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    g = torch.Generator().manual_seed(seed)
    result = TrainResult()
    model.train()
    t0 = time.perf_counter()
    running, count = 0.0, 0
    bar = tqdm(range(steps), desc="training", disable=not progress, mininterval=1.0)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = batch_fn(g)
        logits = model(x)  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        count += 1
        result.tokens_seen += x.numel()
        last = step == steps - 1
        if (step + 1) % eval_every == 0 or last:
            result.steps.append(step + 1)
            result.train_loss.append(running / count)
            result.log_seconds.append(time.perf_counter() - t0)
            running, count = 0.0, 0
            if log_eval is not None:
                result.val_steps.append(step + 1)
                log_eval(result)
            bar.set_postfix(loss=f"{result.train_loss[-1]:.3f}")
    result.seconds = time.perf_counter() - t0
    model.eval()
    return result
