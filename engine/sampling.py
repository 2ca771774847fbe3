"""Sampling parameters, and the one place where logits become probabilities.

The target's p and the draft's q go through the same transforms at every drafted position, each
position with its own prefix (committed tokens plus the draft tokens before it). That is what
keeps speculative sampling exact when penalties depend on history.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .grammar import TokenConstraint

MAX_LOGPROBS = 20


class SamplingError(ValueError):
    """A sampling parameter is out of range. ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; N: the chosen token's plus the top N (0..20)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (0.0 <= self.temperature <= 2.0, "temperature", "must be between 0 and 2"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be between -2 and 2"),
            # float32 logits cannot be divided by less (a tiny positive value rounds to 0 and gives inf)
            (0.01 <= self.repetition_penalty <= 100.0, "repetition_penalty", "must be between 0.01 and 100"),
            (self.seed is None or -(2**63) <= self.seed < 2**63, "seed", "must fit in a signed 64-bit integer"),
        ]
        for ok, param, why in checks:
            if not ok:
                raise SamplingError(f"{param} {why}, got {getattr(self, param)!r}", param)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise SamplingError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", name)
        for bias in self.logit_bias.values():
            if not -100.0 <= bias <= 100.0:
                raise SamplingError(f"logit_bias values must be between -100 and 100, got {bias}", "logit_bias")

    @property
    def greedy(self) -> bool:
        # below this, dividing float32 logits by the temperature overflows; it is argmax in all but name
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def uses_history(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class RequestSampler:
    """Turns logits into probabilities for one request and owns its random generator.

    The committed history (prompt and accepted output) lives here; ``probs`` adds the tokens
    drafted on top of it.
    """

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        device: torch.device,
        prompt_ids: list[int],
        seed: int,
        constraint: TokenConstraint | None = None,
    ) -> None:
        """``seed`` seeds this request's generator (the request's own seed when it has one)."""
        self.params = params
        self.constraint = constraint
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed % 2**64)
        self.num_output = 0  # output tokens committed: the position the next token takes
        self._bias = None
        if params.logit_bias:
            self._bias = torch.zeros(vocab_size, device=device)  # [V]
            for token_id, bias in params.logit_bias.items():
                if 0 <= token_id < vocab_size:
                    self._bias[token_id] = bias
        # Penalty state: counts over generated tokens (presence/frequency, as OpenAI defines them) and
        # a mask over prompt plus generated tokens (repetition, as in CTRL and Hugging Face); and the
        # ids either holds, the only logits a penalty can move (``_apply_penalties``).
        self._output_counts = torch.zeros(vocab_size, device=device)  # [V]
        self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V]
        self._touched_ids: set[int] = set()
        self._touched = torch.empty(0, dtype=torch.long, device=device)  # [S] those ids
        if params.repetition_penalty != 1.0 and prompt_ids:
            ids = torch.tensor(prompt_ids, device=device).clamp(0, vocab_size - 1)  # [P]
            self._seen[ids] = True
            self._touch(ids.tolist())

    def commit(self, token_ids: list[int]) -> None:
        """Record tokens that became part of the output."""
        self.num_output += len(token_ids)
        if self.constraint is not None:
            self.constraint.commit(token_ids)
        if not self.params.uses_history or not token_ids:
            return
        ids = torch.tensor(token_ids, device=self.device)
        self._output_counts.index_add_(0, ids, torch.ones(len(token_ids), device=self.device))
        self._seen[ids] = True
        self._touch(token_ids)

    def _touch(self, token_ids: list[int]) -> None:
        new = [token_id for token_id in dict.fromkeys(token_ids) if token_id not in self._touched_ids]
        if new:
            self._touched_ids.update(new)
            self._touched = torch.cat([self._touched, torch.tensor(new, device=self.device)])

    def probs(self, logits: torch.Tensor, appended: torch.Tensor | None = None) -> torch.Tensor:
        """logits [T, V] -> probabilities [T, V] (float32).

        ``appended`` [A] (A >= T - 1) are tokens after the committed history; row t of ``logits``
        follows appended[:A - (T - 1) + t]. The verify pass gives A = k, T = k + 1; a draft step
        gives the draft tokens so far and T = 1.
        """
        logits = self._transformed(logits, appended)  # [T, V]
        if self.params.greedy:
            return one_hot(first_largest(logits), self.vocab_size)  # [T, V]
        logits = logits / self.params.temperature
        if self.params.top_k > 0 and self.params.top_k < self.vocab_size:
            kth = torch.topk(logits, self.params.top_k, dim=-1).values[:, -1:]  # [T, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [T, V]
        if self.params.top_p < 1.0:
            probs = _top_p(probs, self.params.top_p)
        if self.params.min_p > 0.0:
            floor = probs.max(dim=-1, keepdim=True).values * self.params.min_p  # [T, 1]
            probs = probs.masked_fill(probs < floor, 0.0)
        # each row's total summed alone: torch splits a [T, V] sum by the rows beside it (at 2 or more
        # threads a verify row's total differed in its last bit from the same row's at a decode step)
        return probs / torch.cat([probs[row : row + 1].sum(dim=-1, keepdim=True) for row in range(probs.shape[0])])

    def greedy_tokens(self, logits: torch.Tensor, appended: torch.Tensor | None = None) -> torch.Tensor:
        """At temperature 0: logits [T, V] -> [T] the token each row's distribution (``probs``'s
        one-hot row) puts all its mass on, after the same penalties, bias and constraint."""
        return first_largest(self._transformed(logits, appended))  # [T]

    def _transformed(self, logits: torch.Tensor, appended: torch.Tensor | None) -> torch.Tensor:
        """logits [T, V] in float32 over the tokenizer's ids, after penalties, bias and constraint."""
        logits = logits[:, : self.vocab_size].float()  # [T, V]
        if self.params.uses_history:
            logits = self._apply_penalties(logits, appended)
        if self._bias is not None:
            logits = logits + self._bias
        if self.constraint is not None:
            drafted = [] if appended is None else appended.tolist()
            logits = self.constraint.apply(logits.clone(), drafted)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, appended: torch.Tensor | None) -> torch.Tensor:
        """logits [T, V] with the penalties applied, at the ids a penalty can move alone: those of the
        committed history (``_touched``) and the appended tokens. Each is the same arithmetic as over
        the whole row (elsewhere a penalty subtracts zero), at a few hundred ids instead of 49k."""
        rows = logits.shape[0]
        ids = self._touched  # [S]
        if appended is not None and appended.numel():
            ids = torch.cat([ids, appended])  # [S'] an id twice is computed alike in both columns
        counts = self._output_counts[ids].expand(rows, -1)  # [T, S']
        if appended is not None and appended.numel():
            # Row t sees appended[:A - (T - 1) + t]: cumulative counts of the appended tokens.
            hits = (appended[:, None] == ids[None, :]).float()  # [A, S']
            cum = torch.cat([torch.zeros_like(hits[:1]), hits.cumsum(0)])  # [A+1, S']
            first = appended.numel() - (rows - 1)
            counts = counts + cum[first : first + rows]  # [T, S']
        seen = self._seen[ids].expand(rows, -1) | (counts > 0)  # [T, S']
        p = self.params
        moved = logits.index_select(1, ids)  # [T, S']
        moved = moved - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        if p.repetition_penalty != 1.0:
            penalised = torch.where(moved > 0, moved / p.repetition_penalty, moved * p.repetition_penalty)
            moved = torch.where(seen, penalised, moved)
        return logits.index_copy(1, ids, moved)  # [T, V]


def all_finite(logits: torch.Tensor) -> torch.Tensor:
    """[] bool: whether ``logits`` hold no NaN or inf, read from their extremes (NaN propagates through
    min and max), in one pass: several times cheaper on a CPU than isfinite().all(), and not a sum,
    which overflows over 49k float16 logits. On a CPU by numpy: two reductions where torch's five
    small ops took 119-147 us right after a forward (its caches cold) on a 2-core host."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float16, torch.float32, torch.float64):
        values = logits.numpy()
        return torch.tensor(bool(np.isfinite(values.min()) and np.isfinite(values.max())))
    return torch.isfinite(torch.stack(torch.aminmax(logits))).all()


def first_largest(logits: torch.Tensor) -> torch.Tensor:
    """logits [T, V] -> [T] int64: each row's first largest id (a NaN counts as largest), as ``argmax``.
    On a CPU by numpy: torch's took 71 us over a 49k row on a 2-core host, numpy's 4 (a greedy step's
    whole sampling)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1))
    return logits.argmax(-1)


def one_hot(token_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """token_ids [N] -> [N, V] one-hot rows. Unlike F.one_hot, it does not read the ids back to the
    host to check their range, so it never makes the host wait for the device."""
    rows = torch.zeros(token_ids.shape[0], vocab_size, dtype=dtype, device=token_ids.device)  # [N, V]
    return rows.scatter_(-1, token_ids[:, None], 1.0)


# What _top_p tries on CPU before sorting the whole row: the tokens at or above a floor (at most a
# thousand), then the most likely 256 and 4096; and the margin over top_p their mass must clear:
# past it, rounding cannot bring a later token back under top_p.
TOP_P_FLOOR = 1e-3
TOP_P_CANDIDATES = (256, 4096)
TOP_P_MARGIN = 1e-5


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches top_p. probs [T, V].

    On CPU the set is sought first among the tokens at or above ``TOP_P_FLOOR``, row by row (a pass
    over the row and a sort of a few: a third of a partial top-k's time), then among the most likely
    few hundred (a partial top-k costs 25-35 times less than sorting a 49k vocabulary). Either way
    the candidates are the sort's first values in its order, and a prefix's cumulative sums do not
    depend on what follows it, so when their mass reaches top_p (with a margin over rounding; the
    top-k's, less its last candidate) the kept set is the one the full sort keeps. Elsewhere (where
    reading that test back would stall the device) the row is sorted."""
    width = probs.shape[-1]
    if probs.device.type == "cpu" and (kept := _top_p_above_floor(probs, top_p)) is not None:
        return kept
    for candidates in TOP_P_CANDIDATES if probs.device.type == "cpu" else ():
        if candidates >= width:
            break
        values, order = probs.topk(candidates, dim=-1)  # [T, C] descending
        mass_before = values.cumsum(-1) - values  # [T, C]
        if bool((mass_before[:, -1] >= top_p + TOP_P_MARGIN).all()):
            return _keep_until(torch.zeros_like(probs), values, order, mass_before, top_p)
    values, order = probs.sort(dim=-1, descending=True)  # [T, V]
    return _keep_until(torch.zeros_like(probs), values, order, values.cumsum(-1) - values, top_p)


def _top_p_above_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """``_top_p`` of probs [T, V] (on the CPU) among each row's tokens at or above ``TOP_P_FLOOR``,
    found by numpy (a pass over 49k values in 10 us, where torch's comparison and nonzero took 40),
    then sorted; None where a row's fall short of top_p (a flat row, or top_p reaching its tail)."""
    kept = torch.zeros_like(probs)  # [T, V]
    for row in range(probs.shape[0]):
        ids = torch.from_numpy(np.flatnonzero(probs[row].numpy() >= TOP_P_FLOOR))  # [C]
        values, order = probs[row, ids].sort(descending=True)  # [C], [C]
        mass = values.cumsum(-1)  # [C] the mass up to each, in the sort's order
        if not values.numel() or float(mass[-1]) < top_p + TOP_P_MARGIN:
            return None  # a token below the floor may stay (the mass ahead of it is all of theirs)
        _keep_until(kept[row : row + 1], values[None], ids[order][None], (mass - values)[None], top_p)
    return kept


def _keep_until(
    kept: torch.Tensor, values: torch.Tensor, order: torch.Tensor, mass_before: torch.Tensor, top_p: float
) -> torch.Tensor:
    """Write into ``kept`` [T, V] (zeros) the probabilities of the tokens ``order`` [T, C] (by
    descending ``values``) keeps: those whose ``mass_before`` (the mass ahead of them) is under top_p."""
    drop = mass_before >= top_p  # [T, C]
    drop[:, 0] = False  # the most likely token always stays (a tiny top_p rounds to 0 in float32)
    return kept.scatter_(-1, order, values.masked_fill(drop, 0.0))
