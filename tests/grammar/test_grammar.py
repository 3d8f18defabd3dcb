"""Structured output: a grammar's mask inside the one sampler pipeline, plain and speculative.

The demo pair (a small random-ish Qwen3.5 trained on Python source, a byte-level BPE vocabulary
of 4096 tokens, its DFlash2 draft) writes no JSON by itself: every output below is JSON only
because the mask makes it so. Schemas are bounded, so every output of the grammar fits in a
known number of bytes and generation must end with the grammar complete; each output is then
checked by an independent validator (jsonschema-rs).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import jsonschema_rs
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxrunner
from mlxrunner import generate
from mlxrunner import host as plugins
from mlxrunner.decode import (
    MAX_WHITESPACE,
    GrammarError,
    Sampler,
    SamplerOptions,
    allowed_rows,
    compile_format,
)


@pytest.fixture(scope="module")
def demo() -> Any:
    if "demo-qwen3.5" not in plugins.host().registry("models"):
        pytest.skip("the demo plugin (mlxrunner-demo) is not installed")
    return mlxrunner.load("demo-qwen3.5")


def grammar_for(demo: Any, schema: Any, **kwargs: Any) -> Any:
    return compile_format(schema, demo.tokenizer, demo.model.vocab_size,
                          demo.stop_token_ids(), **kwargs)


def prompt_of(demo: Any, text: str = "def parse(line):\n    return") -> list[int]:
    return demo.tokenizer.encode(text)


# ---- bounded schemas and the longest JSON text each admits --------------------------------

# One character of a JSON string is at most 12 bytes of JSON text (a \uXXXX surrogate pair).
_CHAR_BYTES = 12


def leaf_schemas() -> st.SearchStrategy[tuple[dict[str, Any], int]]:
    """(schema, the most bytes a value of it takes without whitespace)."""
    def string(lo: int, hi: int) -> tuple[dict[str, Any], int]:
        return {"type": "string", "minLength": lo, "maxLength": hi}, 2 + _CHAR_BYTES * hi

    def pattern(chars: str, lo: int, hi: int) -> tuple[dict[str, Any], int]:
        return {"type": "string", "pattern": f"^[{chars}]{{{lo},{hi}}}$"}, 2 + hi

    def integer(lo: int, span: int) -> tuple[dict[str, Any], int]:
        hi = lo + span
        return ({"type": "integer", "minimum": lo, "maximum": hi},
                max(len(str(lo)), len(str(hi))))

    def enum(values: list[Any]) -> tuple[dict[str, Any], int]:
        return {"enum": values}, max(len(json.dumps(v)) for v in values) * 6

    small = st.integers(0, 3)
    return st.one_of(
        st.tuples(small, small).map(lambda t: string(min(t), max(t))),
        st.tuples(st.sampled_from(["a-z", "0-9", "A-F"]), small, st.integers(1, 4)).map(
            lambda t: pattern(t[0], min(t[1], t[2]), max(t[1], t[2]))),
        st.tuples(st.integers(-50, 50), st.integers(0, 200)).map(lambda t: integer(*t)),
        st.lists(st.one_of(st.integers(-9, 99), st.sampled_from(["red", "x", "", "ok go"]),
                           st.booleans(), st.none()),
                 min_size=1, max_size=3, unique_by=json.dumps).map(enum),
        st.just(({"type": "boolean"}, 5)),
        st.just(({"type": "null"}, 4)),
    )


def composite(children: st.SearchStrategy[tuple[dict[str, Any], int]]
              ) -> st.SearchStrategy[tuple[dict[str, Any], int]]:
    def obj(props: list[tuple[str, tuple[dict[str, Any], int]]],
            required: list[bool]) -> tuple[dict[str, Any], int]:
        schema = {"type": "object", "properties": {k: v[0] for k, v in props},
                  "required": [k for (k, _), r in zip(props, required) if r],
                  "additionalProperties": False}
        return schema, 2 + sum(len(json.dumps(k)) + 2 + v[1] for k, v in props)

    def arr(item: tuple[dict[str, Any], int], lo: int, hi: int) -> tuple[dict[str, Any], int]:
        return ({"type": "array", "items": item[0], "minItems": lo, "maxItems": hi},
                2 + hi * (item[1] + 1))

    keys = st.sampled_from(["id", "name", "a", "tags", "x y", "k\u00e9"])
    return st.one_of(
        st.lists(st.tuples(keys, children), min_size=1, max_size=3,
                 unique_by=lambda p: p[0]).flatmap(
            lambda props: st.lists(st.booleans(), min_size=len(props),
                                   max_size=len(props)).map(lambda req: obj(props, req))),
        st.tuples(children, st.integers(0, 1), st.integers(1, 3)).map(
            lambda t: arr(t[0], min(t[1], t[2]), max(t[1], t[2]))),
    )


def bounded_schemas() -> st.SearchStrategy[tuple[dict[str, Any], int]]:
    """Objects at the top (as response formats are), nested up to two levels."""
    return composite(st.recursive(leaf_schemas(), composite, max_leaves=4)).filter(
        lambda s: s[0].get("type") == "object" and s[1] <= 120)


def check_output(demo: Any, schema: dict[str, Any], result: Any, bound: int) -> Any:
    text = demo.tokenizer.decode(result.tokens)
    assert result.finish_reason == "stop", (text, bound)
    value = json.loads(text)
    jsonschema_rs.validator_for(schema).validate(value)
    return value


# ---- hypothesis: outputs parse and validate -----------------------------------------------


@settings(max_examples=10, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
@given(case=bounded_schemas(), seed=st.integers(0, 2**16), greedy=st.booleans())
def test_plain_outputs_validate_against_generated_schemas(demo, case, seed, greedy) -> None:
    schema, bound = case
    grammar = grammar_for(demo, schema, max_whitespace=0)
    options = SamplerOptions(temperature=0.0 if greedy else 1.0, top_k=0, top_p=1.0, seed=seed)
    # every token is at least one byte, so a bounded grammar completes within `bound` tokens
    result = generate(demo.model, prompt_of(demo), options=options, max_tokens=bound + 1,
                      eos_ids=demo.stop_token_ids(), constraint=grammar.constraint())
    check_output(demo, schema, result, bound)


@settings(max_examples=4, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
@given(case=bounded_schemas(), seed=st.integers(0, 2**16))
def test_speculative_outputs_validate_and_greedy_equals_plain(demo, case, seed) -> None:
    schema, bound = case
    grammar = grammar_for(demo, schema, max_whitespace=0)
    eos = demo.stop_token_ids()
    greedy = SamplerOptions(temperature=0.0)
    plain = generate(demo.model, prompt_of(demo), options=greedy, max_tokens=bound + 1,
                     eos_ids=eos, constraint=grammar.constraint())
    spec = generate(demo.model, prompt_of(demo), options=greedy, max_tokens=bound + 1,
                    eos_ids=eos, constraint=grammar.constraint(), draft=demo.draft)
    assert spec.stats.rounds > 0
    assert spec.tokens == plain.tokens
    check_output(demo, schema, spec, bound)
    sampled = SamplerOptions(temperature=1.0, top_k=0, top_p=1.0, seed=seed)
    spec = generate(demo.model, prompt_of(demo), options=sampled, max_tokens=bound + 1,
                    eos_ids=eos, constraint=grammar.constraint(), draft=demo.draft)
    check_output(demo, schema, spec, bound)


# ---- fixed cases -----------------------------------------------------------------------------


def test_json_mode_with_whitespace_and_default_sampling(demo) -> None:
    """JSON mode (any object) with the default whitespace bound and the model's own sampler,
    plain and speculative: an object, and no run of whitespace past the bound."""
    grammar = grammar_for(demo, "json")
    free = demo.tokenizer.decode(generate(demo.model, prompt_of(demo), max_tokens=4,
                                          options=demo.defaults.merged({"seed": 0})).tokens)
    assert not free.lstrip().startswith("{"), "the demo model writes JSON unprompted"
    for seed, draft in [(0, None), (1, demo.draft)]:
        options = demo.defaults.merged({"seed": seed, "temperature": 0.9})
        result = generate(demo.model, prompt_of(demo), options=options, max_tokens=120,
                          eos_ids=demo.stop_token_ids(), constraint=grammar.constraint(),
                          draft=draft)
        text = demo.tokenizer.decode(result.tokens)
        assert text.startswith("{"), text
        assert max(len(run) for run in re.findall(r"\s*", text)) <= MAX_WHITESPACE, text
        if result.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_numbers_and_a_required_list(demo) -> None:
    schema = {"type": "object", "properties": {
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}},
        "required": ["score", "items"], "additionalProperties": False}
    grammar = grammar_for(demo, schema, max_whitespace=0)
    result = generate(demo.model, prompt_of(demo), options=SamplerOptions(temperature=0),
                      max_tokens=200, eos_ids=demo.stop_token_ids(),
                      constraint=grammar.constraint(), draft=demo.draft)
    value = check_output(demo, schema, result, 200)
    assert -1 <= value["score"] <= 1 and 1 <= len(value["items"]) <= 2


def test_end_token_only_where_the_grammar_may_end(demo) -> None:
    grammar = grammar_for(demo, {"type": "object", "properties": {"a": {"type": "boolean"}},
                                 "required": ["a"], "additionalProperties": False},
                          max_whitespace=0)
    constraint = grammar.constraint()
    eos = sorted(demo.stop_token_ids())
    vocab = demo.model.vocab_size
    seen_end = []
    for piece in ['{"a":', "true", "}"]:
        rows = np.array(allowed_rows([constraint.words()], vocab))[0]
        seen_end.append(bool(rows[eos].any()))
        for token in demo.tokenizer.encode(piece):
            assert constraint.allows(token)
            constraint.advance(token)
    final = np.array(allowed_rows([constraint.words()], vocab))[0]
    assert seen_end == [False, False, False]
    assert constraint.complete and constraint.can_end
    assert set(np.flatnonzero(final)) == set(eos)


def test_rollback_and_clone_give_the_same_masks(demo) -> None:
    grammar = grammar_for(demo, "json")
    constraint = grammar.constraint()
    tokens = demo.tokenizer.encode('{"key": [1, 2, {"b": null}], "c": "d')
    before = []
    for token in tokens:
        before.append(constraint.words())
        constraint.advance(token)
    twin = constraint.clone()
    constraint.rollback(5)
    np.testing.assert_array_equal(constraint.words(), before[-5])
    for token in tokens[-5:]:
        constraint.advance(token)
    np.testing.assert_array_equal(constraint.words(), twin.words())
    twin.advance(demo.tokenizer.encode('"')[0])
    assert not np.array_equal(constraint.words(), twin.words())
    with pytest.raises(RuntimeError):
        constraint.rollback(len(tokens) + 1)


def test_the_mask_comes_before_every_stage(demo) -> None:
    """Against a float64 reference: greedy, top-k/top-p, penalties and logprobs see only
    the allowed tokens, renormalised over them."""
    rng = np.random.default_rng(0)
    vocab = 64
    logits = rng.normal(size=(1, vocab)).astype(np.float32) * 3
    allowed_ids = np.array([3, 17, 18, 40, 63])
    words = np.zeros(2, dtype=np.uint32)
    for t in allowed_ids:
        words[t >> 5] |= np.uint32(1 << (t & 31))
    allowed = allowed_rows([words.view(np.int32)], vocab)
    assert set(np.flatnonzero(np.array(allowed[0]))) == set(allowed_ids)
    x = mx.array(logits)
    greedy = Sampler(SamplerOptions(temperature=0), vocab)
    assert int(greedy.sample(x, [], allowed)) == allowed_ids[np.argmax(logits[0, allowed_ids])]
    history = [int(allowed_ids[np.argmax(logits[0, allowed_ids])])]
    options = SamplerOptions(temperature=0.7, top_k=4, top_p=0.95, repeat_penalty=1.3,
                             repeat_last_n=8)
    dist = Sampler(options, vocab).distributions(x, [history], allowed)
    dense = np.array(dist.dense(vocab))[0]
    assert dense[np.setdiff1d(np.arange(vocab), allowed_ids)].sum() == 0
    # reference: penalise, keep the 4 best allowed, softmax at T, top_p
    ref = logits[0].astype(np.float64)
    h = history[0]
    ref[h] = ref[h] * 1.3 if ref[h] < 0 else ref[h] / 1.3
    order = allowed_ids[np.argsort(-ref[allowed_ids], kind="stable")][:4]
    p = np.exp((ref[order] - ref[order].max()) / 0.7)
    p /= p.sum()
    keep = (np.cumsum(p) - p) < 0.95
    p = np.where(keep, p, 0)
    p /= p.sum()
    expected = np.zeros(vocab)
    expected[order] = p
    np.testing.assert_allclose(dense, expected, atol=1e-6)
    sampler = Sampler(SamplerOptions(top_logprobs=8), vocab)
    chosen, top_ids, top_lp = sampler.logprobs(x, mx.array([3]), allowed)
    z = logits[0, allowed_ids].astype(np.float64)
    ref_lp = z - np.log(np.exp(z - z.max()).sum()) - z.max()
    assert float(chosen[0]) == pytest.approx(ref_lp[0], abs=1e-5)
    finite = [(int(i), float(v)) for i, v in zip(np.array(top_ids[0]), np.array(top_lp[0]))
              if v > -math.inf]
    assert sorted(i for i, _ in finite) == sorted(allowed_ids.tolist())


def test_logprobs_under_a_grammar_are_the_constrained_distribution(demo) -> None:
    grammar = grammar_for(demo, {"enum": ["yes", "no"]}, max_whitespace=0)
    options = SamplerOptions(temperature=0, logprobs=True, top_logprobs=5)
    result = generate(demo.model, prompt_of(demo), options=options, max_tokens=10,
                      eos_ids=demo.stop_token_ids(), constraint=grammar.constraint())
    assert json.loads(demo.tokenizer.decode(result.tokens)) in ("yes", "no")
    first = result.logprobs[0]
    # only the tokens the grammar allows at the start are alternatives, and they sum to 1
    assert 1 <= len(first["top_logprobs"]) <= 5
    allowed = grammar.constraint()
    assert all(allowed.allows(t) for t, _ in first["top_logprobs"])
    if len(first["top_logprobs"]) < 5:
        assert sum(math.exp(v) for _, v in first["top_logprobs"]) == pytest.approx(1, abs=1e-4)


@pytest.mark.parametrize(("value", "message"), [
    ("yaml", "format must be 'json' or a JSON Schema object"),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "format: the JSON Schema"),
    ({"type": "string", "pattern": "(unclosed"}, "format: the JSON Schema"),
    ({"enum": ["x" * 70_000]}, "at most 65536 are taken"),
    # validates, but admits no text: refused when compiled, not at a batch's first step
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "format: the JSON Schema is not supported"),
])
def test_bad_formats_are_one_clear_line(demo, value, message) -> None:
    with pytest.raises(GrammarError) as caught:
        grammar_for(demo, value)
    text = str(caught.value)
    assert message in text and "\n" not in text, text


def test_free_text_has_no_grammar(demo) -> None:
    assert grammar_for(demo, None) is None and grammar_for(demo, "") is None


def test_speculative_sampling_is_exact_under_the_mask(demo) -> None:
    """Sampled speculative decoding under a grammar follows plain decoding's exact masked
    distribution: the second and third tokens' joint (enumerated over the grammar's support)
    against seeded runs, by chi-square (the first token comes from the prefill, before any
    draft). The draft proposes the script '"def"' (point masses): a proposal the grammar
    allows is verified against the masked p (accepted with probability p, else the masked
    residual), one it forbids gives way to the grammar's forced token or ends the proposal."""
    from mlxrunner.testing.speculative import ScriptedDraft, chi_square

    grammar = grammar_for(demo, {"enum": ["def", "class", "import", "return", "if x"]},
                          max_whitespace=0)
    options = SamplerOptions(temperature=1.5, top_k=0, top_p=1.0)
    prompt = prompt_of(demo)
    draft = ScriptedDraft.for_script(demo.model, prompt + demo.tokenizer.encode('"def"'),
                                     wrong_every_round=False)
    vocab = demo.model.vocab_size
    sampler = Sampler(options, vocab)
    ends = demo.stop_token_ids()
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        grown: dict[tuple[int, ...], float] = {}
        for prefix, mass in joint.items():
            constraint = grammar.constraint()
            for token in prefix:
                constraint.advance(token)
            if prefix and (prefix[-1] in ends or constraint.complete):
                grown[prefix] = mass  # ended: nothing follows
                continue
            logits = demo.model(mx.array([prompt + list(prefix)]))[:, -1, :]
            dist = sampler.distributions(logits, [prompt + list(prefix)],
                                         allowed_rows([constraint.words()], vocab))
            probs = np.array(dist.dense(vocab), dtype=np.float64)[0]
            for token in np.flatnonzero(probs > 0):
                grown[prefix + (int(token),)] = mass * probs[token]
        joint = grown
    tails = sorted({key[1:3] for key in joint})
    expected = np.array([sum(m for k, m in joint.items() if k[1:3] == tail) for tail in tails])
    counts = np.zeros(len(tails))
    drafted = accepted = 0
    for seed in range(150):
        result = generate(demo.model, prompt, options=options.merged({"seed": seed}),
                          max_tokens=3, eos_ids=ends, constraint=grammar.constraint(),
                          draft=draft)
        drafted += result.stats.drafted
        accepted += result.stats.accepted
        counts[tails.index(tuple(result.tokens[1:3]))] += 1
    assert 0 < accepted < drafted, (accepted, drafted)  # both verdicts were exercised
    _, dof, p = chi_square(counts, expected / expected.sum())
    assert dof >= 2, "too few outcomes to test anything"
    assert p > 1e-3, (p, dict(zip(tails, counts)), expected)
