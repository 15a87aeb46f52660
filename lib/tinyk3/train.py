"""A small, honest training loop for the course's CPU experiments."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .data import get_batch

__all__ = ["TrainResult", "train_lm", "evaluate_loss"]


@dataclass
class TrainResult:
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)  # running mean over each interval
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens_seen: int = 0


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
    """Next-token training with AdamW, linear warm-up then cosine decay to 10 % of ``lr``."""
    import math

    from tqdm.auto import tqdm

    block_size = block_size or model.config.block_size
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
        x, y = get_batch(train_data, batch_size, block_size, g)
        logits = model(x)  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
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
            running, count = 0.0, 0
            if val_data is not None:
                result.val_steps.append(step + 1)
                result.val_loss.append(evaluate_loss(model, val_data, batch_size, block_size))
            bar.set_postfix(loss=f"{result.train_loss[-1]:.3f}")
    result.seconds = time.perf_counter() - t0
    model.eval()
    return result
