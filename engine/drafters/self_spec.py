"""Self-speculation: the target drafts for itself with a subset of its own layers.

No second model is loaded. The draft runs the chosen layers (plus the target's own final norm and
LM head) and writes those layers' keys and values into the target's cache at the positions it
drafts; the verify pass feeds the same positions through every layer and overwrites them, so the
committed cache is always the target's own. Which layers to keep comes from ``calibrate`` (stored
under engine/calibration/) or ``--self-layers``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..config import ConfigError
from ..model.model import CausalLM
from ..sampling import RequestSampler
from .base import Drafter, DraftResources, Proposal, sample_chain
from .registry import register

log = logging.getLogger(__name__)
CALIBRATION_DIR = Path(__file__).resolve().parent.parent / "calibration"


class SelfDrafter(Drafter):
    name = "self"

    def __init__(self, target: CausalLM, layers: tuple[int, ...]) -> None:
        if not layers or any(not 0 <= layer < len(target.layers) for layer in layers):
            raise ConfigError(f"self layers must be a non-empty subset of 0..{len(target.layers) - 1}, got {layers}")
        self.target = target
        self.layers = tuple(sorted(set(layers)))

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        """The draft reads the target's own cache: nothing of its own to prepare."""

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        start = self.target.cache.length  # the target's committed KV ends here
        pending = token_ids[start:]
        position = start + len(pending)

        def advance(token: torch.Tensor) -> torch.Tensor:
            nonlocal position
            logits = self.target.draft_through(token, position, self.layers)  # [1] -> [1, V]
            position += 1
            return logits

        logits = self.target.draft_through(pending, start, self.layers)  # [1, V]
        return sample_chain(logits, advance, num_draft_tokens, sampler)

    def accept(self, num_committed: int) -> None:
        """The verify pass already overwrote every drafted position with the full model's KV."""

    def target_layer_sets(self) -> list[tuple[int, ...]]:
        return [self.layers]


def calibration_file(model_name: str) -> Path:
    return CALIBRATION_DIR / f"{model_name.rstrip('/').split('/')[-1]}.json"


def default_layers(target: CausalLM, model_name: str) -> tuple[int, ...]:
    path = calibration_file(model_name)
    if path.is_file():
        return tuple(json.loads(path.read_text())["layers"])
    # Without a calibration: keep the first quarter and the last half (late layers matter most for
    # the output distribution; an untrained early exit seldom agrees with the target).
    count = len(target.layers)
    layers = tuple(range(count // 4)) + tuple(range(count // 2, count))
    log.info(
        "no self-speculation calibration for %s; using layers %s (run specserve calibrate-self)", model_name, layers
    )
    return layers


@torch.inference_mode()
def agreement(target: CausalLM, token_ids: list[int], layers: tuple[int, ...], reference: torch.Tensor) -> float:
    """Teacher-forced share of positions where the layer subset's argmax equals ``reference`` [T]."""
    logits = target.draft_through(token_ids, 0, layers, num_logits=len(token_ids))  # [T, V]
    return float((logits.argmax(-1) == reference).float().mean())


@torch.inference_mode()
def calibrate(target: CausalLM, token_ids: list[int], keep: int) -> tuple[tuple[int, ...], float]:
    """Greedily drop the layer whose removal hurts greedy agreement least, until ``keep`` remain."""
    everything = tuple(range(len(target.layers)))
    reference = target.draft_through(token_ids, 0, everything, num_logits=len(token_ids)).argmax(-1)  # [T]
    layers, score = everything, 1.0
    while len(layers) > keep:
        candidates = [tuple(layer for layer in layers if layer != drop) for drop in layers]
        scores = [agreement(target, token_ids, candidate, reference) for candidate in candidates]
        best = max(range(len(candidates)), key=scores.__getitem__)
        layers, score = candidates[best], scores[best]
        log.info("%d layers: agreement %.3f (dropped %s)", len(layers), score, sorted(set(everything) - set(layers)))
    target.cache.rollback(0)  # calibration wrote scratch keys and values
    return layers, score


@register("self", SelfDrafter)
def _build(resources: DraftResources) -> SelfDrafter:
    layers = resources.config.self_layers
    if layers is None:
        layers = default_layers(resources.target, resources.config.target or "SmolLM2-135M-Instruct")
    return SelfDrafter(resources.target, layers)
