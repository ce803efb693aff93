"""Constrained decoding through xgrammar (the grammar engine vLLM and SGLang use).

A request's constraint (a JSON schema, any JSON object, or a model's tool-call structural tag) is
compiled once, off the step path (the engine compiles it in a worker thread before the request enters
a stage) and cached by its spec. On each step the stage fills one bitmask row per constrained request
from its matcher; the sampler applies the mask as a tensor of fixed shape (`apply_token_bitmask`), so
unconstrained rows and captured steps are unaffected. After the step the sampled token advances the matcher.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

MAX_CACHED_GRAMMARS = 256
BITS = 32  # tokens per int32 word of a bitmask row


class ConstraintError(ValueError):
    """The constraint cannot be compiled (an invalid or unsupported schema)."""

    @classmethod
    def of(cls, what: str, exc: Exception) -> ConstraintError:
        """xgrammar's message without its log prefix ("[time] file.cc:line: ")."""
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
        return cls(f"{what} cannot be used for constrained decoding: {message}")


class Constraint:
    """A compiled grammar and, where the stage runs, the request's matcher. It pickles (to a stage's worker
    process) as the grammar's serialized JSON; the matcher is made again there on the first step."""

    __slots__ = ("key", "_compiled", "_json", "matcher")

    def __init__(self, key: str, compiled: Any):
        self.key, self._compiled, self._json, self.matcher = key, compiled, None, None

    def __getstate__(self) -> dict:
        return {"key": self.key, "json": self._json or self._compiled.serialize_json()}

    def __setstate__(self, state: dict) -> None:
        self.key, self._compiled, self._json, self.matcher = state["key"], None, state["json"], None

    def matcher_for(self, grammars: Grammars):
        import xgrammar as xgr

        if self.matcher is None:
            if self._compiled is None:
                self._compiled = xgr.CompiledGrammar.deserialize_json(self._json, grammars.tokenizer_info)
            self.matcher = xgr.GrammarMatcher(self._compiled)
        return self.matcher


class Grammars:
    """Compiles constraint specs for one tokenizer, caching the last MAX_CACHED_GRAMMARS by spec. Thread-safe:
    the engine compiles from worker threads; the tokenizer's table is built on first use."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, list(stop_ids)
        self._info = self._compiler = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    @property
    def tokenizer_info(self):
        import xgrammar as xgr

        with self._lock:
            if self._info is None:
                self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self.stop_ids)
            return self._info

    def compile(self, spec: dict) -> Constraint:
        """`spec`: {"type": "json_schema", "schema": {...}}, {"type": "json_object"} or {"type":
        "structural_tag", "tag": {...}}. Blocking (call it off the event loop); ConstraintError if invalid."""
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return Constraint(key, self._cache[key])
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return Constraint(key, compiled)

    def _compile(self, spec: dict):
        import xgrammar as xgr

        info = self.tokenizer_info
        with self._lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            compiler = self._compiler
        try:
            if spec["type"] in ("json_schema", "json_object"):
                return compiler.compile_grammar(json_schema_ebnf(spec.get("schema", {"type": "object"})))
            return compiler.compile_structural_tag(spec["tag"])
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConstraintError.of("the schema", exc) from exc


# xgrammar 0.2.9 writes a length-bounded string's characters as this class, which lets raw control characters
# through (JSON allows them only escaped); its unbounded strings already exclude them
_LOOSE_CHARS, _JSON_CHARS = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]'


def json_schema_ebnf(schema: dict) -> str:
    """The grammar (EBNF) of JSON text that matches `schema`, written as json.dumps writes it (no free
    whitespace: a model with nothing to say cannot fill its budget with blanks). ConstraintError if invalid."""
    import xgrammar as xgr

    try:
        ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ConstraintError.of("the schema", exc) from exc
    return ebnf.replace(_LOOSE_CHARS, _JSON_CHARS)


def response_format_spec(response_format: dict | None) -> dict | None:
    """The constraint of a response format ({"type": "json_object"}, {"type": "json_schema", "schema": ...});
    None for free text."""
    if response_format is None or response_format.get("type") == "text":
        return None
    if response_format["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "schema": response_format["schema"]}


class GrammarMasks:
    """Per step, the bitmask rows of a batch's constrained requests (None when no row is constrained), and
    the matchers advanced by the sampled tokens. One per stage runner, used from its thread only."""

    def __init__(self, grammars: Grammars):
        self.grammars = grammars
        self._host: torch.Tensor | None = None

    def fill(self, constraints: list[Constraint | None]) -> torch.Tensor | None:
        """[rows, words] int32 on the host: the allowed tokens of constrained rows, all bits set elsewhere."""
        if all(c is None for c in constraints):
            return None
        words = (self.grammars.vocab_size + BITS - 1) // BITS
        if self._host is None or self._host.shape[0] < len(constraints):
            self._host = torch.empty(max(len(constraints), 8), words, dtype=torch.int32)
        mask = self._host[:len(constraints)]
        mask.fill_(-1)
        for i, c in enumerate(constraints):
            if c is not None:
                c.matcher_for(self.grammars).fill_next_token_bitmask(mask, i)
        return mask

    def accept(self, constraints: list[Constraint | None], tokens: list[int]) -> None:
        for c, token in zip(constraints, tokens):
            if c is not None and not c.matcher_for(self.grammars).accept_token(token):
                raise ConstraintError(f"token {token} does not continue the constrained output")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits [rows, vocab] with the tokens whose bit is clear in `bitmask` [rows, words] set to -inf: fixed
    shapes and no host data, so it runs the same eagerly and inside a captured step."""
    shifts = torch.arange(BITS, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :logits.shape[-1]]
    return logits.masked_fill(~allowed, float("-inf"))
