"""Drafting strategies, chosen by name. Importing this package registers them all."""

from . import auto, eagle3, medusa, model, ngram, self_spec, staged, suffix  # noqa: F401  (each registers its drafter)
from .base import Drafter, DraftResources, Proposal
from .registry import DrafterSet, available, build, can_refine, check_stages, register

__all__ = [
    "DraftResources",
    "Drafter",
    "DrafterSet",
    "Proposal",
    "available",
    "build",
    "can_refine",
    "check_stages",
    "register",
]
