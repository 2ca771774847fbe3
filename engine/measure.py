"""What start-up measures of the models on this host, and the draft copy it picks from that.

The auto drafter prices its candidates from these timings before any request has run; ``copy:auto``
chooses which copy of the target drafts (bfloat16, or int8 rows with bfloat16 activations) by the
same measures, because hosts differ in which copy steps faster (docs/drafters.md). The bfloat16
copy is timed under its own measured plan, packed where that pays.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from .adaptive import expected_tokens, plain_price
from .cpu.int8_blocks import held_activations
from .cpu.matmul import thread_clock, thread_share, weight_key
from .cpu.memory import release_freed_memory
from .cpu.plan_cache import PlanCache, digest
from .model.model import CausalLM
from .model.timing import synchronize

# How much more than the target alone a copy must promise for copy:auto to keep it beside the auto
# drafter (which can do without one). Start-up times bare forwards; a live step also samples,
# carries q and keeps books: on an idle Xeon an int8 copy's live step cost 18.2 ms against its timed
# 16.6, and a verify of one draft 21.9 ms against 19.1. A copy promising 0.4-1% more (the int8
# copy here, three starts) then runs at break-even or below, and holds 135 MB.
KEEP_MARGIN = 1.10

# copy:auto estimates a copy's step from copies of its first four decoder layers and its first, before
# reading a whole one (estimated_step); an estimate is taken at EVEN_IF of itself when judging whether
# a copy could pay at all (at full acceptance, which no copy reaches: 0.95-0.98 here), and a form is
# ruled out only after a second look. Measured, an estimate fell within 25% of the whole copy's step
# either way: a copy that would pay by a hair can still be ruled out, one that pays clearly is not.
ESTIMATE_LAYERS = (4, 1)
EVEN_IF = 0.9

log = logging.getLogger(__name__)


def read_seconds(model: CausalLM, num_tokens: int, repeats: int, num_logits: int = 1, start: int = 0) -> float:
    """The best of ``repeats`` timed forwards of ``model`` over ``num_tokens`` tokens after the first
    ``start`` of its cache (kept; from an empty cache by default), with logits for the last
    ``num_logits`` (a verify scores every row: each costs a row of the LM head, a tenth of a step for
    the embedded model). The cache is left at ``start``."""
    best = float("inf")
    for _ in range(repeats):
        model.cache.rollback(start)
        started = time.perf_counter()
        model.extend([0] * num_tokens, num_logits)
        synchronize(model.device)
        best = min(best, time.perf_counter() - started)
    model.cache.rollback(start)
    return best


VERIFY_CONTEXT = 256  # cached tokens start-up times a verify after, as in a chat turn (each row reads them)
# read in chunks this long: a GGUF target multiplies up to 32 rows by its blocks' kernels, more by decoded
# float32 tiles, whose temporaries raised a target-only server's peak RSS by 20-50 MB past issue 51's 500 MB
CONTEXT_CHUNK = 32


def verify_seconds(target: CausalLM, max_draft_tokens: int, rounds: int = 3) -> list[float]:
    """A verify's forward at each k in 0..max_draft_tokens (k drafts and the pending token, all
    scored) after a chat turn's context, read once: the best of ``rounds`` rounds over every k (the
    first forwards after a long read run up to a third slower). From an empty cache a row cost half
    what it does there (0.45 against 1.0-1.5 ms with the embedded int8 target), and a first request
    drafted at that price. The cache is left empty."""
    context = max(min(VERIFY_CONTEXT, target.max_len - max_draft_tokens - 1), 0)
    target.cache.rollback(0)
    for start in range(0, context, CONTEXT_CHUNK):  # a chunk's rows by the blocks' own kernels: no decoded tiles
        target.extend([0] * min(CONTEXT_CHUNK, context - start), num_logits=0)
    best = [float("inf")] * (max_draft_tokens + 1)
    for _ in range(rounds):
        for k in range(max_draft_tokens + 1):
            best[k] = min(best[k], read_seconds(target, k + 1, 1, num_logits=k + 1, start=context))
    target.cache.rollback(0)
    return best


def prefill_seconds_per_token(model: CausalLM, num_tokens: int = 128) -> float:
    """What reading a prompt costs ``model`` per token on this host (the first read pays first-call costs)."""
    num_tokens = min(num_tokens, model.max_len)
    return read_seconds(model, num_tokens, repeats=2) / num_tokens


def extra_row_seconds(
    model: CausalLM, num_rows: int, one_row_seconds: float, repeats: int = 3, scored: bool = False
) -> float:
    """What each row beyond the first adds to a short forward of ``model`` (one row: ``one_row_seconds``);
    ``scored``: with logits for every row, as a verify computes them (a catch-up needs the last only)."""
    extra = read_seconds(model, num_rows, repeats, num_rows if scored else 1) - one_row_seconds
    return max(extra, 0.0) / max(num_rows - 1, 1)


@torch.inference_mode()
def agreement(draft: CausalLM, target: CausalLM, num_tokens: int = 32) -> float:
    """How often the draft model's proposals would pass, before any request: the draft writes
    ``num_tokens`` greedily from the start token, the target reads them in one pass, and the mean
    of sum(min(p, q)) over the positions (a draft token's acceptance probability, 1 - total
    variation) is the answer."""
    num_tokens = min(num_tokens, draft.max_len - 1, target.max_len - 1)
    start = target.config.bos_token_id if isinstance(target.config.bos_token_id, int) else 0
    draft.cache.rollback(0)
    token_ids, draft_probs = [start], []
    for _ in range(num_tokens):
        probs = torch.softmax(draft.extend(token_ids[-1:])[-1].float(), dim=-1)  # [V]
        draft_probs.append(probs)
        token_ids.append(int(probs.argmax()))
    target.cache.rollback(0)
    target_probs = torch.softmax(target.extend(token_ids[:-1], num_tokens).float(), dim=-1)  # [T, V]
    draft.cache.rollback(0)
    target.cache.rollback(0)
    overlap = torch.minimum(target_probs, torch.stack(draft_probs)).sum(-1)  # [T]
    return float(overlap.mean())


def choose_copy(
    target: CausalLM,
    read_copy: Callable[..., CausalLM],
    num_draft_tokens: int,
    cache: PlanCache | None = None,
    may_keep_none: bool = False,
) -> tuple[CausalLM | None, str, float | None]:
    """``copy:auto``: the bfloat16 copy of the target, or the same weights as int8 rows, whichever
    promises more tokens per second: expected_tokens(agreement, k) over k draft steps and a verify,
    each timed here, at its best k up to ``num_draft_tokens``. With ``may_keep_none`` (a start-up
    drafter that can do without a draft model), neither unless one promises KEEP_MARGIN more than
    the target alone decodes: a copy that cannot pay only costs memory and auto's probes. Off CPU
    (no int8 kernel there) the bfloat16 copy, unmeasured. Returns the chosen model (None: none),
    what it is ("bfloat16", "int8" or "none"), and its measured agreement with the target (None: not
    measured). ``read_copy`` gives a fresh bfloat16 copy at each call (``read_copy(n)``: of its first
    n decoder layers): one is read to be timed, then quantized in place and timed as int8 rows
    (start-up never holds two copies), and read again only where the bfloat16 one is kept. With
    ``may_keep_none``, a form whose step, estimated from small copies (``estimated_step``), could
    not pay even if every draft passed is neither read whole nor timed: where neither could, no
    copy is read at all.
    With a ``cache``, the choice is stored under the host and the target's weights (unless timed on
    a busy host) and read back at the next start of the same model on this host, which then times
    nothing and reads only the copy it keeps (none: nothing): the choice holds between starts, as
    the matmul plan does; ``--matmul-plan measure`` chooses again."""
    if target.device.type != "cpu":
        return read_copy(), "bfloat16", None
    max_rows = num_draft_tokens + 2
    target.weights.plan_matmuls(min(max_rows, target.max_len), cache)  # first: it frees what it holds in another form
    # stored for a model loaded from somewhere (one built in-process has no name)
    key = _choice_key(target, cache, num_draft_tokens, may_keep_none) if cache and target.config.name_or_path else ""
    stored = cache.load_record(key, "copy:auto choice") if key else None
    if stored is not None and stored.get("choice") in ("none", "bfloat16", "int8"):
        log.info("draft copy:auto chose %s (stored, measured %s)", stored.get("found"), stored.get("measured"))
        return _kept_copy(stored["choice"], read_copy, max_rows, cache), stored["choice"], stored.get("agreement")
    log.info("draft copy:auto: timing a bfloat16 and an int8 copy of the target on this host to keep the faster")
    started = thread_clock()
    most = max(num_draft_tokens, 1)
    read_seconds(target, 1, repeats=1)  # first-call costs
    alone = read_seconds(target, 1, repeats=3)
    per_row = extra_row_seconds(target, most + 1, alone, 2, scored=True)  # a verify of k drafts: alone + k * per_row
    rates, found, agreements = {"none": 1 / alone}, {}, {}
    forms, estimates = ["bfloat16", "int8"], {}  # int8 last: where it wins, the copy timed is the one kept
    if may_keep_none:  # a copy too slow to pay even if every draft passed is not read whole
        for form in list(forms):
            estimates[form] = estimated_step(form, read_copy, len(target.layers), max_rows)
            if not could_pay(estimates[form], alone, per_row, most):  # a second look before ruling it out
                estimates[form] = min(estimates[form], estimated_step(form, read_copy, len(target.layers), max_rows))
            if not could_pay(estimates[form], alone, per_row, most):
                forms.remove(form)
                found[form] = (
                    f"{form} (step estimated at {estimates[form] * 1e3:.1f} ms: no k pays even if every draft passed)"
                )
        release_freed_memory()
    model = None
    if forms:
        model = _kept_copy("bfloat16", read_copy, max_rows, cache) if "bfloat16" in forms else read_copy()
    for form in forms:
        if form == "int8":  # the bfloat16 copy read (and timed) becomes the int8 one, product by product
            model.weights.quantize_int8()
            release_freed_memory()
        read_seconds(model, 1, repeats=1)  # first-call costs
        step, agreements[form] = read_seconds(model, 1, repeats=3), agreement(model, target)
        rates[form], k = max((_drafting_rate(agreements[form], step, alone, per_row, k), k) for k in range(1, most + 1))
        estimated = f", estimated {estimates[form] * 1e3:.1f}" if form in estimates else ""
        found[form] = (
            f"{form} (step {step * 1e3:.1f} ms{estimated}, agreement {agreements[form]:.3f}, "
            f"{rates[form]:.1f} tok/s at k = {k})"
        )
    found["none"] = f"none (the target alone: step {alone * 1e3:.1f} ms, {rates['none']:.1f} tok/s)"
    candidates = [form for form in rates if may_keep_none or form != "none"]
    chosen = max(candidates, key=lambda form: rates[form] / (KEEP_MARGIN if form != "none" and may_keep_none else 1))
    others = ", ".join(text for form, text in found.items() if form != chosen and (may_keep_none or form != "none"))
    log.info("draft copy:auto chose %s over %s", found[chosen], others)
    if key:
        choice = {"choice": chosen, "agreement": agreements.get(chosen), "found": found[chosen]}
        cache.save_record(key, "copy:auto choice", choice, thread_share(started))
    if chosen != (forms[-1] if forms else "none"):  # the copy timed last is let go; the chosen one is read
        model = None
        release_freed_memory()
        model = _kept_copy(chosen, read_copy, max_rows, cache)
    return model, chosen, agreements.get(chosen)


def estimated_step(form: str, read_copy: Callable[..., CausalLM], num_layers: int, max_rows: int) -> float:
    """A decode step of the whole copy in ``form``, estimated from copies of its first four decoder
    layers and of its first (each with the embedding and LM head): the one-layer step, plus each
    further layer at the difference's share, the two timed in turn. In a server's first starts on an
    idle Xeon: int8 copies estimated at 19.0-27.2 ms where whole ones stepped in 22.3-26.8 (one
    start: 19.0 against 25.4), bfloat16 ones at 37.3-42.4 ms where whole ones stepped in 37.6-44.0.
    The bfloat16 copies run under a plan measured on the larger one (the same shapes)."""
    counts = sorted({min(layers, num_layers) for layers in ESTIMATE_LAYERS}, reverse=True)
    models, plan = {}, None
    for layers in counts:
        model = models[layers] = read_copy(layers)
        if form == "int8":
            model.weights.quantize_int8()
        elif plan is None:
            plan = model.weights.plan_matmuls(max_rows)
        else:
            model.weights.use_plan(plan)
        read_seconds(model, 1, repeats=1)  # first-call costs
    steps = dict.fromkeys(models, float("inf"))
    for _ in range(7):  # taking turns, so that a disturbance hits both alike
        for layers, model in models.items():
            steps[layers] = min(steps[layers], read_seconds(model, 1, repeats=1))
    models.clear()
    if len(counts) == 1:  # a model of one layer: timed whole
        return steps[counts[0]]
    more = counts[0]
    return steps[1] + (num_layers - 1) * max(steps[more] - steps[1], 0.0) / (more - 1)


def could_pay(step: float, alone: float, per_row: float, most: int) -> bool:
    """Whether a copy stepping in ``step`` (taken at EVEN_IF of it) could promise KEEP_MARGIN more
    than the target alone (a step of ``alone``, ``per_row`` more a verified draft) at some k up to
    ``most``, were every draft to pass: (k + 1) tokens for k draft steps and a verify of k rows."""
    best = max(_drafting_rate(1.0, step * EVEN_IF, alone, per_row, k) for k in range(1, most + 1))
    return best >= KEEP_MARGIN / alone


def _drafting_rate(agreement: float, step: float, alone: float, per_row: float, k: int) -> float:
    """Tokens a second drafting k a step with a copy stepping in ``step``: k draft steps and a
    verify of k rows (the target's step ``alone`` plus ``per_row`` a row) per step."""
    return expected_tokens(agreement, k) / (k * step + alone + k * per_row)


def _kept_copy(
    form: str, read_copy: Callable[..., CausalLM], max_rows: int, cache: PlanCache | None
) -> CausalLM | None:
    """The copy ``copy:auto`` keeps: None, the bfloat16 copy under its plan, or int8 rows made from it."""
    if form == "none":
        return None
    model = read_copy()
    if form == "bfloat16":
        model.weights.plan_matmuls(min(max_rows, model.max_len), cache)
    else:
        model.weights.quantize_int8()
    return model


def _choice_key(target: CausalLM, cache: PlanCache, num_draft_tokens: int, may_keep_none: bool) -> str:
    """What ``copy:auto``'s choice is stored under: the host and the target's weights (their shapes,
    which are GGUF blocks, and what those multiply), which model it is (agreement depends on its
    values), k and whether none may be kept."""
    weights = target.weights
    host = cache.key([weight_key(shape) for shape in weights.shapes], list(weights.blocks_by_shape()), 0)
    named = [host, held_activations(target), target.config.name_or_path, num_draft_tokens, may_keep_none, KEEP_MARGIN]
    return "copy-auto-" + digest(named)


def robust_line(values: list[float]) -> list[float]:
    """A line through ``values`` (at x = 0, 1, ...) that one disturbed reading cannot tip: the median
    of the pairwise slopes (at least 0), through the median of what each point leaves for the
    intercept (Theil-Sen), no point below half the cheapest reading (nothing is free). A
    least-squares line through five start-up timings, one caught by a busy host, could price plain
    decoding below zero."""
    n = len(values)
    if n == 0:
        return []  # nothing timed (no drafts: only a plain step's reading, priced apart)
    pairs = [(values[j] - values[i]) / (j - i) for i in range(n) for j in range(i + 1, n)]
    slope = max(statistics.median(pairs), 0.0) if pairs else 0.0
    intercept = statistics.median(y - slope * x for x, y in enumerate(values))
    return [max(intercept + slope * x, min(values) / 2) for x in range(n)]


def verify_prices(timed: list[float]) -> dict[int, float]:
    """Start-up's prices of a verify by k from its timings (``verify_seconds``): the robust line over
    k >= 1, and a plain step (k = 0) apart, at most the line at k = 1 less one row. A plain step does
    less than a verify of one draft, whose first row costs at least what each further one does (the
    int8 target: 1.3-1.8 ms against 0.7-1.0), so a plain reading above that was disturbed: one at
    11.3 ms against 10.4 at k = 1 (a busy moment of the host) made every one-token draft look free,
    and the plain steps that would have corrected the price were seldom taken. Never below half the
    cheapest reading (nothing is free), where a disturbed line is steeper than its first point."""
    line = robust_line(timed[1:])
    if not line:
        return {0: timed[0]}  # no drafts: a plain step alone
    row = line[1] - line[0] if len(line) > 1 else 0.0
    return {0: plain_price(timed[0], line[0], row, min(timed))} | dict(enumerate(line, start=1))


def fitted_line(values: list[float]) -> list[float]:
    """The least-squares line through ``values`` (at x = 0, 1, ...), its slope at least 0."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    spread = sum((x - mean_x) ** 2 for x in range(n))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / spread if spread else 0.0
    slope = max(slope, 0.0)
    return [mean_y + slope * (x - mean_x) for x in range(n)]
