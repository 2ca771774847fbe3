"""The rejection sampler of speculative decoding (Leviathan et al., 2023; Chen et al., 2023).

A pure function of tensors and an explicit generator: no model, no state. ``p`` is the
target's distribution and ``q`` the draft's, after the same sampling transforms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import one_hot


class NonFiniteProbabilities(ValueError):
    """The target's distribution holds NaN or inf (or no mass): nothing can be sampled from it."""


NON_FINITE = "the target's probabilities are not finite (NaN or inf in the logits)"


@dataclass(frozen=True, slots=True)
class Verdict:
    num_accepted: int  # how many draft tokens were kept, 0..n
    token_ids: list[int]  # the kept drafts, then the resampled token at the first rejection or the bonus token
    num_proposed: int  # n: the drafts that counted (k, or fewer when a device-side cutoff ended the draft)

    @property
    def next_token(self) -> int:
        return self.token_ids[-1]


def rejection_sample(
    draft_tokens: torch.Tensor,  # [k] int64
    q: torch.Tensor | None,  # [k, V] draft probabilities; None means deterministic (one-hot) drafts
    p: torch.Tensor,  # [k+1, V] target probabilities at each draft position plus the bonus position
    generator: torch.Generator | None,
    num_proposed: torch.Tensor | None = None,  # [] n <= k: only the first n drafts were proposed; None: all k
) -> Verdict:
    """Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)).

    At the first rejection, sample from norm(max(0, p_i - q_i)); if all n pass, sample the bonus
    token from p_n. The result is distributed exactly as sampling from p alone.
    Everything stays on the device until one transfer at the end: the number accepted, the next
    token, and the drafts themselves (so a step never copies drafts to the host on their own).
    """
    k = draft_tokens.shape[0]
    rows = torch.arange(k, device=p.device)
    if q is None:
        q = one_hot(draft_tokens, p.shape[-1], p.dtype)  # [k, V]
    p_x, q_x = p[rows, draft_tokens], q[rows, draft_tokens]  # [k], [k]
    u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)  # [k]
    accepted = u * q_x < p_x  # [k]; u < p/q without dividing by q
    num_accepted, num_proposed = _accepted_prefix(accepted, num_proposed)  # [], []
    residual = (p[:k] - q).clamp_min(0)  # [k, V] where to resample after a rejection at row i
    # p_i == q_i leaves no residual; a rejection there has probability zero, but guard rounding.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:k])
    # all n passed: the bonus token comes from p_n, the target's distribution after the n drafts
    all_passed = num_accepted == num_proposed  # []
    # Rows picked by index_select: indexing with a 0-d tensor (p[num_accepted]) reads it back to the host.
    at = num_accepted.view(1)  # [1]
    candidates = torch.cat([residual, p[k:]])  # [k+1, V]; row k is the bonus distribution p_k
    next_from = torch.where(all_passed, p.index_select(0, at), candidates.index_select(0, at))[0]  # [V]
    total = next_from.sum()  # []
    usable = torch.isfinite(total) & (total > 0)  # NaN anywhere in the row poisons the sum
    return _verdict(num_accepted, sample_one(next_from, generator), usable, num_proposed, draft_tokens)


def greedy_verdict(
    draft_tokens: torch.Tensor,  # [k] int64
    target_tokens: torch.Tensor,  # [k+1] the target's greedy token at each draft position and the bonus one
    finite: torch.Tensor,  # [] bool: the target's logits hold no NaN or inf
    num_proposed: torch.Tensor | None = None,  # [] n <= k, as for rejection_sample
    on_host: bool | None = None,  # None: on the host where the tokens are (a CPU), else on their device
) -> Verdict:
    """``rejection_sample``'s verdict where p is one-hot at ``target_tokens`` (temperature 0), whatever
    q is: min(1, p/q) accepts x_i exactly when x_i is the target's token, and norm(max(0, p_i - q_i))
    is one-hot at it again, so the kept drafts are the longest prefix matching the target's tokens,
    then the target's token after them. No draws and no [k+1, V] rows; on a device, one transfer to
    the host. On a CPU there is no transfer to save: read from host lists, where the device's dozen
    small ops took 148-164 us right after a forward (their caches cold) on a 2-core host."""
    if on_host is None:
        on_host = target_tokens.device.type == "cpu"
    if on_host:
        if not bool(finite):
            raise NonFiniteProbabilities(NON_FINITE)
        drafts, targets = draft_tokens.tolist(), target_tokens.tolist()
        n = len(drafts) if num_proposed is None else int(num_proposed)
        kept = next((i for i in range(n) if drafts[i] != targets[i]), n)
        return Verdict(kept, drafts[:kept] + [targets[kept]], n)
    matched = draft_tokens == target_tokens[: draft_tokens.shape[0]]  # [k]
    num_accepted, num_proposed = _accepted_prefix(matched, num_proposed)  # [], []
    token = target_tokens.index_select(0, num_accepted.view(1))[0]  # []
    return _verdict(num_accepted, token, finite, num_proposed, draft_tokens)


def _accepted_prefix(accepted: torch.Tensor, num_proposed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """accepted [k] bool, each draft's own test -> (how many drafts are kept [], n []): the drafts
    before the first that failed, none past n (drafts past a device-side cutoff were never
    proposed); n is k where ``num_proposed`` is None (a fill: no host-to-device copy)."""
    k = accepted.shape[0]
    if num_proposed is None:
        num_proposed = torch.full((), k, dtype=torch.long, device=accepted.device)  # []
    else:
        accepted = accepted & (torch.arange(k, device=accepted.device) < num_proposed)  # [k]
    return accepted.long().cumprod(0).sum(), num_proposed


def _verdict(
    num_accepted: torch.Tensor,
    token: torch.Tensor,
    usable: torch.Tensor,
    num_proposed: torch.Tensor,
    drafts: torch.Tensor,
) -> Verdict:
    """The step's one transfer to the host: the number accepted, the next token, whether the
    target's distribution was usable, n, and the drafts themselves ([] each, drafts [k])."""
    head = torch.stack([num_accepted, token, usable.long(), num_proposed.long()])  # [4]
    num, token_id, ok, proposed, *draft_ids = torch.cat([head, drafts]).tolist()
    if not ok:
        raise NonFiniteProbabilities(NON_FINITE)
    return Verdict(num, draft_ids[:num] + [token_id], proposed)


def sample_one(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw [] from unnormalised non-negative ``weights`` [V] with a uniform from ``generator``."""
    u = torch.rand(1, generator=generator, device=weights.device, dtype=torch.float64)  # [1]
    return inverse_cdf(weights.unsqueeze(0), u)[0]


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's draw from unnormalised non-negative ``weights`` [R, V] at the uniform ``u`` [R] in
    [0, 1): the first id whose cumulative weight passes u times the row's total (about 20x cheaper
    than ``torch.multinomial`` over a 49k vocabulary on CPU). A zero-weight id adds nothing to the
    sum, so it is never the first entry above the draw; the last clamp keeps a draw that rounds up
    to the total on the last id with weight. The sum runs in float64: in float32, rounding over 49k
    partial sums could shift up to ~1e-7 of mass per id. Returns [R] int64."""
    cumulative = weights.double().cumsum(-1)  # [R, V]
    total = cumulative[:, -1:].contiguous()  # [R, 1]
    index = torch.searchsorted(cumulative, u.unsqueeze(1) * total, right=True)  # [R, 1]
    last = torch.searchsorted(cumulative, total).clamp_max(weights.shape[-1] - 1)  # [R, 1]; NaN weights: in range
    return torch.minimum(index, last)[:, 0]


# ---- seeded requests: randomness keyed by position ------------------------------------------------
# A seeded request's token at output position t is the target's draw from p_t at the uniform
# u(seed, t), whatever was drafted: a draft is kept exactly when it equals that draw. The output is
# then the target alone's for that seed, and its law is the target's (a fresh uniform at each t).
# u is a counter-based hash (splitmix64) computed on the device in int64 arithmetic, which wraps alike
# on every device: no generator state to consume, no host-to-device copy.

_MASK = 2**64 - 1  # a Python integer's low 64 bits, as an unsigned 64-bit register holds them
_GOLDEN, _MIX1, _MIX2 = (c - 2**64 for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >> bits as unsigned 64-bit integers (torch shifts int64 arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def keyed_uniforms(seed: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    """u(seed, t) for t = start .. start + count - 1: [count] float64 in [0, 1), 53 random bits each.
    On a CPU the host's integers compute them (a dozen tensor operations cost a step 50 us)."""
    if device.type != "cpu":
        return device_uniforms(seed, start, count, device)
    key = _splitmix_int(seed & _MASK)
    draws = [(_splitmix_int(key ^ (t & _MASK)) >> 11) * 2.0**-53 for t in range(start, start + count)]
    return torch.tensor(draws, dtype=torch.float64)  # [count]


def _splitmix_int(x: int) -> int:
    """``_splitmix`` over unsigned 64-bit Python integers: the same bits."""
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK
    return x ^ (x >> 31)


def device_uniforms(seed: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    """``keyed_uniforms`` computed on ``device`` in int64 arithmetic (no host-to-device copy)."""
    key = _splitmix(torch.full((), (seed + 2**63) % 2**64 - 2**63, dtype=torch.long, device=device))  # []
    positions = torch.arange(start, start + count, dtype=torch.long, device=device)  # [count]
    return _shift_right(_splitmix(key ^ positions), 11).double() * 2.0**-53


def keyed_tokens(p: torch.Tensor, seed: int, start: int) -> torch.Tensor:
    """The target's draws [R] from ``p`` [R, V], row i at output position ``start + i``."""
    return inverse_cdf(p, keyed_uniforms(seed, start, p.shape[0], p.device))
