"""The rejection sampler of speculative decoding (Leviathan et al., 2023; Chen et al., 2023).

A pure function of tensors and an explicit generator: no model, no state. ``p`` is the
target's distribution and ``q`` the draft's, after the same sampling transforms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Verdict:
    num_accepted: int  # how many draft tokens were kept, 0..k
    next_token: int  # the resampled token at the first rejection, or the bonus token


def rejection_sample(
    draft_tokens: torch.Tensor,  # [k] int64
    q: torch.Tensor | None,  # [k, V] draft probabilities; None means deterministic (one-hot) drafts
    p: torch.Tensor,  # [k+1, V] target probabilities at each draft position plus the bonus position
    generator: torch.Generator | None,
) -> Verdict:
    """Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)).

    At the first rejection, sample from norm(max(0, p_i - q_i)); if all k pass, sample the bonus
    token from p_k. The result is distributed exactly as sampling from p alone.
    """
    k = draft_tokens.shape[0]
    if k == 0:
        return Verdict(0, _sample(p[0], generator))
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, draft_tokens]  # [k]
    q_x = torch.ones_like(p_x) if q is None else q[rows, draft_tokens]  # [k]
    u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)  # [k]
    accepted = u * q_x < p_x  # [k]; u < p/q without dividing by q
    num_accepted = int(accepted.long().cumprod(0).sum())
    if num_accepted == k:
        return Verdict(k, _sample(p[k], generator))
    p_i = p[num_accepted]  # [V]
    if q is None:
        q_i = torch.zeros_like(p_i)
        q_i[draft_tokens[num_accepted]] = 1.0
    else:
        q_i = q[num_accepted]
    residual = (p_i - q_i).clamp_min(0)  # [V]
    if float(residual.sum()) <= 0:  # p_i == q_i: a rejection has probability zero; guard rounding
        residual = p_i
    return Verdict(num_accepted, _sample(residual, generator))


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from unnormalised non-negative ``weights`` [V]."""
    return int(torch.multinomial(weights, 1, generator=generator))
