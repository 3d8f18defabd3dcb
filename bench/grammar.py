"""Grammar engines for structured output, side by side: why mlxrunner uses llguidance.

For each installed engine (llguidance through ``mlxrunner.decode.grammar``, as shipped;
outlines-core through its own Vocabulary/Index/Guide) on real tokenizers (the default
model's, SmolLM2's 49,152 tokens, built from its GGUF file; Qwen3.5's 248,320 from the shared
data), this measures:

- the vocabulary's preparation (once per tokenizer);
- a schema's compile time, on a nested product schema and on JSON mode (any object);
- the next-token mask along a valid document, token by token (mask, then commit): mean,
  median, 99th percentile and worst, in microseconds;
- JSON Schema coverage: for a schema using each of a list of keywords, whether the engine
  refuses it, or compiles it and then enforces it (a document that breaks the keyword is
  not accepted whole) or ignores it (the breaking document is accepted);
- what each distribution installs (bytes on disk), its licence and its run-time
  requirements; ``--wheels DIR`` adds wheels not installed (xgrammar's: its requirements are
  read from the wheel, not run).

Prints a table and writes JSON (``--json``, default ``bench/results/grammar-cpu.json``).

    python bench/grammar.py
    PYTHONPATH=/tmp/outlines python bench/grammar.py --wheels /tmp/wheels
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import zipfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent

PRODUCT = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "price": {"type": "number", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 5},
        "stock": {"type": "object", "properties": {
            "warehouse": {"enum": ["north", "south", "east"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 100000}},
            "required": ["warehouse", "count"], "additionalProperties": False},
        "discontinued": {"type": "boolean"},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["id", "name", "sku", "price", "stock"],
    "additionalProperties": False,
}
PRODUCT_DOC = {"id": 7, "name": "Espresso cup, white", "sku": "CUP-0042", "price": 12.5,
               "tags": ["kitchen", "porcelain"], "stock": {"warehouse": "north", "count": 310},
               "discontinued": False, "notes": None}
OBJECT_DOC = {"query": "capital of France", "answer": {"city": "Paris", "population": 2102650},
              "sources": ["atlas", "census 2023"], "confident": True}

_LEAF = {"type": "string"}
#: keyword -> (schema, a document breaking only that keyword, or None)
COVERAGE: dict[str, tuple[Any, Any]] = {k: (v, None) for k, v in {
    "enum/const": {"type": "object", "properties": {"a": {"enum": [1, "x", None]},
                                                    "b": {"const": "k"}}},
    "string lengths": {"type": "string", "minLength": 2, "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email/uuid": {"type": "object", "properties": {
        "e": {"type": "string", "format": "email"}, "u": {"type": "string", "format": "uuid"}}},
    "integer range": {"type": "integer", "minimum": -5, "maximum": 300},
    "exclusive bounds": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "array bounds": {"type": "array", "items": _LEAF, "minItems": 1, "maxItems": 3},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, _LEAF],
                    "items": False},
    "anyOf": {"anyOf": [{"type": "integer"}, _LEAF]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": _LEAF}},
                        {"required": ["a"]}]},
    "$ref/$defs": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}}},
                   "type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}},
    "recursive $ref": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"},
    "additionalProperties schema": {"type": "object",
                                    "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x-": _LEAF}},
    "min/maxProperties": {"type": "object", "minProperties": 1, "maxProperties": 2},
    "if/then/else": {"type": "object", "if": {"properties": {"a": {"const": 1}}},
                     "then": {"required": ["b"]}},
    "type list": {"type": ["integer", "null"]},
}.items()}
for _feature, _breaking in {
    "string lengths": "abcdefg", "pattern": "a@b.org", "integer range": 301,
    "exclusive bounds": 0, "multipleOf": 7, "array bounds": [], "uniqueItems": [1, 1],
    "prefixItems": [1, "a", 2], "oneOf": "x", "allOf": {}, "additionalProperties schema":
    {"k": "v"}, "min/maxProperties": {}, "if/then/else": {"a": 1}, "enum/const": {"b": "j"},
}.items():
    COVERAGE[_feature] = (COVERAGE[_feature][0], _breaking)


def shared_data() -> Path:
    return Path(os.environ.get("MLXRUNNER_SHARED_DATA", REPO.parent / "shared" / "data"))


def tokenizers_to_run(names: list[str]) -> list[tuple[str, Any, int, set[int]]]:
    """(name, mlxrunner Tokenizer, model vocabulary, end ids) for each available one."""
    from mlxrunner.model.tokenizer import Tokenizer

    found = []
    for name in names:
        if name == "smollm2":
            from mlxrunner.model.gguf import gguf_tokenizer, read_gguf

            store = Path(os.environ.get("MLXRUNNER_MODELS", Path.home() / ".mlxrunner/models"))
            files = sorted(store.glob("smollm2*/*.gguf"))
            if not files:
                print("smollm2: not in the model store (mlxrunner pull smollm2:135m); skipped")
                continue
            tok = gguf_tokenizer(read_gguf(files[0]))
            found.append((f"smollm2 ({tok.vocab_size})", tok, tok.vocab_size,
                          set(tok.eos_ids)))
        elif name == "qwen3.5":
            path = shared_data() / "tokenizers" / "qwen3_5-tokenizer.json.gz"
            if not path.is_file():
                print(f"qwen3.5: {path} not found; skipped")
                continue
            tok = Tokenizer.from_file(path)
            end = tok.token_to_id("<|im_end|>")
            found.append(("qwen3.5 (248320)", tok, 248320, {end} if end is not None else set()))
    return found


# -- engines --------------------------------------------------------------------------------


class LLGuidance:
    name = "llguidance"
    distribution = "llguidance"

    def prepare(self, tok: Any, vocab: int, eos: set[int]) -> None:
        from mlxrunner.decode.grammar import vocabulary

        self.tok, self.vocab, self.eos = tok, vocab, eos
        vocabulary(tok, vocab, eos)

    def compile(self, schema: Any) -> Any:
        from mlxrunner.decode.grammar import compile_format

        grammar = compile_format("json" if schema == "json" else schema, self.tok, self.vocab,
                                 self.eos)
        assert grammar is not None
        return grammar.constraint()

    def words(self, state: Any) -> np.ndarray:
        return state.words()

    def advance(self, state: Any, token: int) -> None:
        state.advance(token)

    def accepts(self, state: Any) -> bool:
        return bool(state.can_end)


class OutlinesCore:
    name = "outlines-core"
    distribution = "outlines_core"

    def prepare(self, tok: Any, vocab: int, eos: set[int]) -> None:
        import outlines_core

        # byte-level BPE: token text is bytes spelled through GPT-2's byte-to-character table
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                     *range(ord("\xae"), ord("\xff") + 1)]
        chars = {chr(b): b for b in printable}
        extra = 0
        for b in range(256):
            if b not in printable:
                chars[chr(256 + extra)] = b
                extra += 1
        special = set(tok.special_tokens.values())
        tokens: dict[bytes, list[int]] = {}
        for text, token_id in tok.backend.get_vocab(with_added_tokens=False).items():
            if token_id in special:
                continue
            try:
                spelled = bytes(chars[c] for c in text)
            except KeyError:  # not byte-level (a byte-fallback vocabulary): its own text
                spelled = text.replace("\u2581", " ").encode()
            tokens.setdefault(spelled, []).append(token_id)
        self.words_count = (vocab + 31) // 32
        self.vocabulary = outlines_core.Vocabulary(min(eos), tokens)

    def compile(self, schema: Any) -> Any:
        import outlines_core

        text = json.dumps({"type": "object"} if schema == "json" else schema)
        regex = outlines_core.json_schema.build_regex_from_schema(text)
        return outlines_core.Guide(outlines_core.Index(regex, self.vocabulary))

    def words(self, state: Any) -> np.ndarray:
        out = np.zeros(self.words_count, dtype=np.int32)
        state.write_mask_into(out.ctypes.data, out.size, out.itemsize)
        return out

    def advance(self, state: Any, token: int) -> None:
        state.advance(token)

    def accepts(self, state: Any) -> bool:
        return bool(state.is_finished())


ENGINES: dict[str, Callable[[], Any]] = {"llguidance": LLGuidance,
                                         "outlines-core": OutlinesCore}


def _allowed(words: np.ndarray, token: int) -> bool:
    return bool((int(words.view(np.uint32)[token >> 5]) >> (token & 31)) & 1)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def walk(engine: Any, state: Any, ids: list[int]) -> dict[str, Any]:
    """Mask then commit each token of a valid document: per-token mask times."""
    times = []
    for token in ids:
        words, seconds = timed(lambda: engine.words(state))
        times.append(seconds * 1e6)
        if not _allowed(words, token):
            return {"error": f"token {token} of the document not allowed"}
        engine.advance(state, token)
    ordered = sorted(times)
    return {"tokens": len(ids), "mean_us": round(statistics.fmean(times), 1),
            "median_us": round(statistics.median(times), 1),
            "p99_us": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
            "max_us": round(ordered[-1], 1)}


def installed(distribution: str) -> dict[str, Any]:
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return {"installed": False}
    size = 0
    for file in dist.files or []:
        path = Path(str(dist.locate_file(file)))
        if path.is_file():
            size += path.stat().st_size
    requires = [r for r in dist.requires or [] if "extra ==" not in r]
    return {"installed": True, "version": dist.version, "installed_bytes": size,
            "licence": dist.metadata.get("License-Expression") or dist.metadata.get("License"),
            "requires": requires}


def wheel_facts(path: Path) -> dict[str, Any]:
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = wheel.read(name).decode().splitlines()
    requires = [line.split(":", 1)[1].strip() for line in lines
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
    licence = next((line.split(":", 1)[1].strip() for line in lines
                    if line.startswith(("License-Expression:", "License:"))), None)
    return {"wheel": path.name, "wheel_bytes": path.stat().st_size, "licence": licence,
            "requires": requires}


def verdict(engine: Any, tok: Any, schema: Any, breaking: Any) -> str:
    """'refused: ...', 'enforced', 'ignored' (a document breaking the keyword got through), or
    'compiled' (no breaking document to try)."""
    try:
        state = engine.compile(schema)
    except Exception as err:
        return f"refused: {str(err).splitlines()[0][:120]}"
    if breaking is None:
        return "compiled"
    for token in tok.encode(json.dumps(breaking)):
        if not _allowed(engine.words(state), token):
            return "enforced"
        engine.advance(state, token)
    return "ignored" if engine.accepts(state) else "enforced"


def bench_engine(engine: Any, tok: Any, vocab: int, eos: set[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _, out["prepare_s"] = timed(lambda: engine.prepare(tok, vocab, eos))
    for label, schema, doc, indent in [("product", PRODUCT, PRODUCT_DOC, None),
                                       ("json_object", "json", OBJECT_DOC, None)]:
        try:
            state, seconds = timed(lambda s=schema: engine.compile(s))
        except Exception as err:  # an engine that cannot take it: recorded, not fatal
            out[label] = {"error": str(err).splitlines()[0][:200]}
            continue
        ids = tok.encode(json.dumps(doc, indent=indent))
        out[label] = {"compile_ms": round(seconds * 1e3, 2), **walk(engine, state, ids)}
    coverage = {feature: verdict(engine, tok, schema, breaking)
                for feature, (schema, breaking) in COVERAGE.items()}
    out["coverage"] = coverage
    out["coverage_enforced"] = sum(v in ("enforced", "compiled") for v in coverage.values())
    out["coverage_ignored"] = sorted(k for k, v in coverage.items() if v == "ignored")
    out["coverage_refused"] = sorted(k for k, v in coverage.items() if v.startswith("refused"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", nargs="+", default=["smollm2", "qwen3.5"])
    parser.add_argument("--wheels", type=Path, help="a folder of engine wheels to describe")
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/grammar-cpu.json")
    args = parser.parse_args()

    engines = []
    for name, make in ENGINES.items():
        engine = make()
        facts = installed(engine.distribution)
        if facts["installed"]:
            engines.append(engine)
        else:
            print(f"{name}: not installed; skipped")
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                    "cpus": os.cpu_count()},
        "distributions": {e.name: installed(e.distribution) for e in ENGINES.values()
                          if installed(e().distribution)["installed"]},
        "wheels": [wheel_facts(p) for p in sorted(args.wheels.glob("*.whl"))]
        if args.wheels else [],
        "tokenizers": {},
    }
    for label, tok, vocab, eos in tokenizers_to_run(args.tokenizers):
        results["tokenizers"][label] = {e.name: bench_engine(e, tok, vocab, eos)
                                        for e in engines}

    print(f"\n{'tokenizer':18} {'engine':14} {'prepare s':>9} {'compile ms':>10} "
          f"{'mask us mean/p99/max':>22} {'json mode compile ms':>20} {'mask us mean':>12} "
          f"{'enforced':>8}  ignored / refused")
    for label, per_engine in results["tokenizers"].items():
        for name, r in per_engine.items():
            p, j = r["product"], r["json_object"]
            mask = (f"{p['mean_us']}/{p['p99_us']}/{p['max_us']}" if "mean_us" in p
                    else p.get("error", "?")[:22])
            print(f"{label:18} {name:14} {r['prepare_s']:9.3f} {p.get('compile_ms', '-'):>10} "
                  f"{mask:>22} {j.get('compile_ms', j.get('error', '?')[:18]):>20} "
                  f"{j.get('mean_us', '-'):>12} "
                  f"{r['coverage_enforced']:>5}/{len(COVERAGE)}  "
                  f"{', '.join(r['coverage_ignored']) or '-'} / "
                  f"{', '.join(r['coverage_refused']) or '-'}")
    for name, facts in results["distributions"].items():
        print(f"{name}: {facts['version']}, {facts['installed_bytes'] / 2**20:.1f} MiB "
              f"installed, licence {facts['licence']}, requires {facts['requires'] or 'nothing'}")
    for facts in results["wheels"]:
        print(f"{facts['wheel']}: {facts['wheel_bytes'] / 2**20:.1f} MiB, licence "
              f"{facts['licence']}, requires {facts['requires'] or 'nothing'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
