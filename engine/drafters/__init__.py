"""Drafting strategies, chosen by name. Importing this package registers them all."""

from . import model  # noqa: F401  (registers "model")
from .base import Drafter, DraftResources, Proposal, available, build, register

__all__ = ["DraftResources", "Drafter", "Proposal", "available", "build", "register"]
