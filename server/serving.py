"""The OpenAI serving layer: completions and chat over one shared core (see generation.py)."""

from __future__ import annotations

from .chat import ChatServing
from .completions import CompletionsServing


class OpenAIServing(CompletionsServing, ChatServing):
    """What the routes call: ``completion``/``completion_stream``, ``chat``/``chat_stream``,
    ``tokenize``/``detokenize``; ``engine`` and ``model_name`` for health and models."""
