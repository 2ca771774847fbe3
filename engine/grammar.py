"""Grammar-constrained decoding (JSON, JSON Schema) with xgrammar.

A ``TokenConstraint`` gives, for every row a sampler scores, the set of tokens the grammar allows
after that row's prefix. The sampler applies it to the target's p and the draft's q alike, so
speculative verification stays exact under the constraint.
"""

from __future__ import annotations

import json

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_STRICT_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


class GrammarError(ValueError):
    pass


class GrammarCompiler:
    """Compiles grammars for one tokenizer; compiled grammars are cached by xgrammar."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: set[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size

    def json_object(self) -> xgr.CompiledGrammar:
        """Any JSON object (xgrammar's built-in JSON grammar would also admit a top-level array)."""
        return self.json_schema({"type": "object"})

    def json_schema(self, schema: dict) -> xgr.CompiledGrammar:
        try:
            grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
            # xgrammar 0.2's rule for length-bounded strings admits raw control characters, which JSON
            # forbids inside strings; exclude them as its unbounded string rule does.
            ebnf = str(grammar).replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR)
            return self._compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
        except Exception as exc:  # xgrammar raises RuntimeError and others for schemas it cannot use
            raise GrammarError(f"invalid or unsupported JSON schema: {exc}") from exc


class TokenConstraint:
    """One request's grammar state: committed tokens advance it; drafted tokens are tried and undone."""

    def __init__(self, grammar: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(grammar)
        self.vocab_size = vocab_size

    def commit(self, token_ids: list[int]) -> None:
        for token in token_ids:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                break

    def apply(self, logits: torch.Tensor, appended: list[int]) -> torch.Tensor:
        """Mask logits [T, V] in place: row t follows appended[:A - (T - 1) + t]. Returns logits."""
        rows = logits.shape[0]
        first = len(appended) - (rows - 1)
        bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)  # [T, ceil(V/32)] int32, all allowed
        tried = 0
        valid = True
        for token in appended[:first]:
            valid = self._accept(token)
            tried += valid
            if not valid:
                break
        for t in range(rows):
            if not valid or self._matcher.is_terminated():
                break  # after a token that broke the grammar (p gives it zero) or a stop token, no row is used
            self._matcher.fill_next_token_bitmask(bitmask, t)
            if t < rows - 1:
                valid = self._accept(appended[first + t])
                tried += valid
        self._matcher.rollback(tried)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
        return logits

    def _accept(self, token: int) -> bool:
        return not self._matcher.is_terminated() and self._matcher.accept_token(token)
