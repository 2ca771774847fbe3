"""Drafting strategies, chosen by name. Importing this package registers them all."""

from . import auto, medusa, model, ngram, self_spec, staged, suffix  # noqa: F401  (each module registers its drafter)
from .base import Drafter, DraftResources, Proposal, available, build, register

__all__ = ["DraftResources", "Drafter", "Proposal", "available", "build", "register"]
