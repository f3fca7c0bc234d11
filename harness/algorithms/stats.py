"""Masked statistics over response tokens, and running mean/std with a parallel merge."""
from __future__ import annotations

import math

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over all positions where mask is 1."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries; masked-out entries come back as 0."""
    return (x - masked_mean(x, mask)) * torch.rsqrt(masked_var(x, mask) + eps) * mask


def perplexity(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(per-sample, token-pooled) perplexity of the response tokens under the model that gave
    `logprobs` ([B, T], masked positions ignored).

    per-sample: mean over the batch of exp(mean NLL of each response). One short response the
    model found unlikely (exp of a large mean NLL) can move it a lot, so it spikes on outliers.
    token-pooled: exp(NLL summed over all response tokens / their count), the corpus perplexity
    language-model papers report; every token weighs the same, so it reads as a smooth curve."""
    nll = -(logprobs * mask)
    n_tok = mask.sum(1).clamp(min=1)
    per_sample = torch.exp(nll.sum(1) / n_tok).mean()
    pooled = torch.exp(nll.sum() / mask.sum().clamp(min=1))
    return per_sample.item(), pooled.item()


class RunningMeanStd:
    """Running mean and variance of a scalar stream, merged batch by batch (Chan et al.).

    `update` merges the whole batch before the batch is normalized, so the statistics used on a
    batch include it (as the reference code does).
    """

    def __init__(self) -> None:
        self.mean = 0.0
        self.var = 1.0  # population variance of everything seen
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().double().flatten()
        if x.numel():
            self.merge(x.mean().item(), x.var(unbiased=False).item(), x.numel())

    def merge(self, mean: float, var: float, count: int) -> None:
        """Merge statistics computed elsewhere (another rank, or a batch: `update`)."""
        if self.count == 0:
            self.mean, self.var, self.count = mean, var, count
            return
        tot = self.count + count
        delta = mean - self.mean
        m2 = self.var * self.count + var * count + delta**2 * self.count * count / tot
        self.mean += delta * count / tot
        self.var = m2 / tot
        self.count = tot

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, s: dict) -> None:
        self.mean, self.var, self.count = float(s["mean"]), float(s["var"]), int(s["count"])
