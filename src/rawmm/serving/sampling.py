"""Next-token sampling with temperature and top-p, reporting the sampled token's log-probability.

The log-probability is taken under the distribution the token was actually drawn from (logits divided
by the temperature, restricted to the top-p nucleus and renormalized), like vLLM's
``processed_logprobs``; at top_p = 1 that is exactly what a trainer computes from ``logits / T``.
Greedy (temperature 0) reports the plain log-softmax.
"""

from __future__ import annotations

import torch


def nucleus_logprobs(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logprobs`` restricted to the smallest set of top tokens whose mass reaches ``top_p``, renormalized."""
    if top_p >= 1.0:
        return logprobs
    sorted_logprobs, order = torch.sort(logprobs, descending=True)
    mass_before = torch.cumsum(sorted_logprobs.exp(), dim=-1) - sorted_logprobs.exp()
    drop_sorted = mass_before >= top_p
    # The top token stays whatever top_p is: one below float32's smallest (1e-46) compares as 0.
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logprobs.masked_fill(drop, float("-inf")), dim=-1)


def sample_token(
    logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[int, float]:
    """Draw one token from 1-D ``logits``; returns (token id, its log-probability)."""
    logits = logits.float()
    if temperature == 0.0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    logprobs = nucleus_logprobs(torch.log_softmax(logits / temperature, dim=-1), top_p)
    token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    return token, float(logprobs[token])
