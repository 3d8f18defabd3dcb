"""Structured output: a grammar (JSON mode or a JSON Schema) as a per-sequence token mask.

The grammar engine is llguidance (bench/grammar.py says why: per-token masks in tens of
microseconds on a 50k vocabulary, schema compiles in about a millisecond, no torch). A
:class:`Grammar` is compiled once for a vocabulary; each sequence then gets its own
:class:`Constraint`, which gives the allowed tokens of the next position, advances on a
committed token, rolls back (a speculative round's rejected suffix) and clones. The sampler
applies the mask before every other stage (:meth:`mlxrunner.decode.Sampler.distributions`),
so greedy, top-k/p, min_p, penalties and logprobs all see the constrained distribution.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from ..errors import MLXRunnerError
from ..model.tokenizer import Tokenizer

#: the largest schema taken, as JSON text: far beyond any schema a request writes by hand
MAX_SCHEMA_CHARS = 64 * 1024
#: whitespace allowed between JSON tokens: a newline and a few levels of indentation; a
#: bound keeps a model from running off into whitespace, which an unbounded pattern allows
MAX_WHITESPACE = 20
# Compile work bounded by llguidance's fuel and size limits (not wall time: the same schema
# compiles the same way on every machine). A tenth of its defaults: a large real schema
# (bench/grammar.py) uses well under it.
_LEXER_FUEL, _GRAMMAR_SIZE, _LEXER_STATES = 100_000, 50_000, 50_000


class GrammarError(MLXRunnerError, ValueError):
    """A schema or format the grammar engine cannot take (one clear line)."""


@dataclass(frozen=True)
class Format:
    """What a request asks its output to be: ``"json"`` (any JSON object) or a JSON Schema."""

    kind: str  # "json" or "json_schema"
    schema: Mapping[str, Any] | None = None

    @classmethod
    def parse(cls, value: Any, *, field: str = "format") -> Format | None:
        """A format as requests write it: None or "" (free text), "json", or a schema
        object (Ollama's ``format``; ``mlxrunner run --format``). ``field`` names it in
        errors."""
        if value is None or value == "":
            return None
        if value == "json":
            return cls("json")
        if isinstance(value, Mapping):
            return cls("json_schema", value)
        raise GrammarError(f"{field} must be 'json' or a JSON Schema object, got {value!r:.80}")

    @classmethod
    def from_openai(cls, value: Any, *, field: str = "response_format") -> Format | None:
        """OpenAI's ``response_format`` (chat: the schema under ``json_schema``) or
        ``text.format`` (responses: beside ``type``): None for ``{"type": "text"}``."""
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise GrammarError(f"{field} must be an object, got {value!r:.80}")
        kind = value.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json")
        if kind == "json_schema":
            holder = value.get("json_schema", value)
            schema = holder.get("schema") if isinstance(holder, Mapping) else None
            if not isinstance(schema, Mapping):
                raise GrammarError(f"{field}: a 'json_schema' format needs a 'schema' object")
            return cls("json_schema", schema)
        raise GrammarError(f"{field}: type {kind!r} is not one of 'text', 'json_object', "
                           "'json_schema'")

    def grammar_text(self, *, max_whitespace: int = MAX_WHITESPACE) -> str:
        """llguidance's grammar for this format (JSON text), before checking."""
        schema: Any = {"type": "object"} if self.kind == "json" else self.schema
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as err:
            raise GrammarError(f"the JSON Schema is not JSON ({err})") from None
        if len(text) > MAX_SCHEMA_CHARS:
            raise GrammarError(f"the JSON Schema is {len(text)} characters long; at most "
                               f"{MAX_SCHEMA_CHARS} are taken")
        if not isinstance(schema, Mapping):
            raise GrammarError(f"a JSON Schema must be an object, got {type(schema).__name__}")
        whitespace = "" if max_whitespace <= 0 else f"[\\x20\\x0A\\x0D\\x09]{{0,{max_whitespace}}}"
        options: dict[str, Any] = {"whitespace_flexible": max_whitespace > 0}
        if whitespace:
            options["whitespace_pattern"] = whitespace
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=options)  # type: ignore[arg-type]
        except ValueError as err:
            raise GrammarError(f"the JSON Schema cannot be read: {_first_line(err)}") from None


def _first_line(err: Any) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else "unknown error"


class Vocabulary:
    """A tokenizer's vocabulary as the grammar engine sees it: token bytes, the end ids.

    Building one walks every token (tens of milliseconds for 250k tokens): :func:`vocabulary`
    keeps one per tokenizer, model width and end-id set.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Iterable[int]) -> None:
        ends = sorted(set(eos_ids) | set(tokenizer.eos_ids))
        if not ends:
            raise GrammarError("structured output needs an end-of-sequence token, and the "
                               "tokenizer has none")
        self.vocab_size = int(vocab_size)
        self.eos_ids = frozenset(ends)
        self.engine = llguidance.LLTokenizer(tokenizer.backend.to_str(),
                                             n_vocab=self.vocab_size, eos_token=ends)
        self.words = (self.vocab_size + 31) // 32


_vocabularies: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[int, frozenset[int]], Vocabulary]]
_vocabularies = weakref.WeakKeyDictionary()
_vocabularies_lock = threading.Lock()


def vocabulary(tokenizer: Tokenizer, vocab_size: int,
               eos_ids: Iterable[int] = ()) -> Vocabulary:
    """The (cached) :class:`Vocabulary` of ``tokenizer`` for a model ``vocab_size`` wide."""
    key = (int(vocab_size), frozenset(eos_ids))
    with _vocabularies_lock:
        per_tokenizer = _vocabularies.setdefault(tokenizer, {})
        found = per_tokenizer.get(key)
        if found is None:
            found = per_tokenizer[key] = Vocabulary(tokenizer, vocab_size, key[1])
        return found


class Grammar:
    """A format compiled for one vocabulary; :meth:`constraint` starts a sequence on it."""

    def __init__(self, form: Format, vocab: Vocabulary, *,
                 max_whitespace: int = MAX_WHITESPACE) -> None:
        self.format = form
        self.vocabulary = vocab
        self._text = form.grammar_text(max_whitespace=max_whitespace)
        self._limits = llguidance.LLParserLimits(
            initial_lexer_fuel=_LEXER_FUEL, max_grammar_size=_GRAMMAR_SIZE,
            max_lexer_states=_LEXER_STATES, verbose_errors=False)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            self._text, vocab.engine, limits=self._limits)
        if failed:
            raise GrammarError(f"the JSON Schema is not supported: {_first_line(messages[0])}")
        # the compiled start state: every sequence begins as a copy of it
        self._start = llguidance.LLMatcher(vocab.engine, self._text, log_level=0,
                                           limits=self._limits)
        if self._start.is_error():
            raise GrammarError(f"the JSON Schema is not supported: "
                               f"{_first_line(self._start.get_error())}")
        # the first position's tokens, on a copy: a grammar that validates may still admit
        # no text at all (a schema that only refers to itself), which would otherwise fail
        # at a generation's first step, inside a batch of other requests
        try:
            first = Constraint(self._start.deep_copy(), vocab).words()
        except RuntimeError as err:
            raise GrammarError(f"the JSON Schema is not supported: {_first_line(err)}"
                               ) from None
        if not first.any():
            raise GrammarError("the JSON Schema admits no value")

    def constraint(self) -> Constraint:
        """A fresh per-sequence constraint at the grammar's start."""
        return Constraint(self._start.deep_copy(), self.vocabulary)


def compile_format(value: Any, tokenizer: Tokenizer, vocab_size: int,
                   eos_ids: Iterable[int] = (), *, field: str = "format",
                   max_whitespace: int = MAX_WHITESPACE) -> Grammar | None:
    """:meth:`Format.parse` then :class:`Grammar`: None for free text. Errors name ``field``."""
    form = value if isinstance(value, Format) else Format.parse(value, field=field)
    if form is None:
        return None
    try:
        return Grammar(form, vocabulary(tokenizer, vocab_size, eos_ids),
                       max_whitespace=max_whitespace)
    except GrammarError as err:
        raise GrammarError(f"{field}: {err}") from None


class Constraint:
    """One sequence's position in a grammar.

    :meth:`words` packs the next position's allowed tokens, one bit per token (bit ``t % 32``
    of word ``t // 32``); :meth:`advance` commits a token; :meth:`rollback` takes committed
    tokens back; :attr:`complete` says nothing but an end token may follow.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab: Vocabulary) -> None:
        self._matcher = matcher
        self.vocabulary = vocab
        self.tokens = 0  # committed so far

    @property
    def vocab_size(self) -> int:
        return self.vocabulary.vocab_size

    def words(self) -> np.ndarray:
        """The allowed tokens of the next position: [ceil(V / 32)] int32 bit words."""
        out = np.zeros(self.vocabulary.words, dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self._check()
        return out

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (without committing it)."""
        return self._matcher.validate_tokens([int(token)]) == 1

    def forced_token(self) -> int | None:
        """The next token when the grammar leaves only one way on (a key's remaining bytes,
        say), else None."""
        forced = self._matcher.compute_ff_tokens()
        return int(forced[0]) if forced else None

    def advance(self, token: int) -> None:
        """Commit ``token``; one the grammar does not allow is a bug in the caller."""
        if not self._matcher.consume_token(int(token)):
            raise RuntimeError(f"token {token} is not allowed here: "
                               f"{self._matcher.get_error()}")
        self.tokens += 1

    def rollback(self, count: int) -> None:
        """Take back the last ``count`` committed tokens."""
        if count <= 0:
            return
        if count > self.tokens or not self._matcher.rollback(count):
            raise RuntimeError(f"cannot roll back {count} of {self.tokens} tokens")
        self.tokens -= count

    def clone(self) -> Constraint:
        twin = Constraint(self._matcher.deep_copy(), self.vocabulary)
        twin.tokens = self.tokens
        return twin

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and takes nothing more (only an end token)."""
        return self._matcher.is_stopped()

    @property
    def can_end(self) -> bool:
        """The text so far is a whole sentence of the grammar (an end token may come)."""
        return self._matcher.is_accepting()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise RuntimeError(f"grammar engine error: {self._matcher.get_error()}")


def allowed_rows(words: Sequence[np.ndarray], vocab_size: int) -> mx.array:
    """Bit words of several positions -> their [R, vocab_size] bool masks (on the device: a
    32nd of the bytes crosses over). Arrays are made per call, on the caller's thread (MLX
    streams belong to the thread that made them: the server decodes on its own)."""
    packed = mx.array(np.stack(words).view(np.uint32))
    bits = (packed[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    return bits.reshape(packed.shape[0], -1)[:, :vocab_size].astype(mx.bool_)
