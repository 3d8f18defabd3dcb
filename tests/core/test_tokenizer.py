"""mlxrunner.Tokenizer: folder reading, encoding, decoding, streaming detokenisation.

Tiny tokenizers (core/mlxrunner/testdata/, written by make_tokenizer_testdata.py)
cover folder reading and the detokenizer's corner cases quickly. The real Gemma 4
and Qwen3.5 tokenizers from the shared data (env MLXRUNNER_SHARED_DATA, default
<repo>/../shared/data) must reproduce llama.cpp's Gemma 4 test vectors and
round-trip arbitrary text.

Normalisations found (and stated in the round-trip expectations below):
- Gemma 4's normalizer turns " " into U+2581 and its decoder turns every U+2581
  back into " ", so a U+2581 in the input decodes as a space.
- Qwen3.5's normalizer is NFC, so text decodes as its NFC form; NFC applies to
  the text between special markers (markers are split off before normalising,
  so "<|im_end|>" followed by U+0338 does not compose into "≯").
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import re
import shutil
import unicodedata
from pathlib import Path

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxrunner
from mlxrunner import ModelFolderError, Tokenizer

REPO = Path(__file__).resolve().parents[2]
TESTDATA = REPO / "core" / "mlxrunner" / "testdata"
BYTELEVEL = TESTDATA / "tokenizer-bytelevel"
BYTEFALLBACK = TESTDATA / "tokenizer-bytefallback"

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


SHARED_TOKENIZERS = (
    Path(os.environ.get("MLXRUNNER_SHARED_DATA", REPO.parent / "shared" / "data")) / "tokenizers"
)
SKIP_REASON = f"shared data absent: no {SHARED_TOKENIZERS} (set MLXRUNNER_SHARED_DATA)"


def shared_tokenizers_dir() -> Path | None:
    return SHARED_TOKENIZERS if SHARED_TOKENIZERS.is_dir() else None


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    detok = tokenizer.detokenizer(skip_special_tokens=skip_special_tokens)
    return [detok.add(i) for i in ids] + [detok.finish()]


def assert_markers_whole(pieces: list[str], markers: list[str]) -> None:
    """No piece boundary falls strictly inside a special marker of the joined text."""
    text = "".join(pieces)
    cuts, offset = set(), 0
    for piece in pieces:
        offset += len(piece)
        cuts.add(offset)
    for marker in markers:
        for found in re.finditer(re.escape(marker), text):
            inside = [c for c in cuts if found.start() < c < found.end()]
            assert not inside, f"marker {marker!r} split at {inside} in {text!r}"


# ---------------------------------------------------------------- tiny folders


@functools.cache
def tiny(folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def bytelevel() -> Tokenizer:
    return tiny(BYTELEVEL)


@pytest.fixture(scope="module")
def bytefallback() -> Tokenizer:
    return tiny(BYTEFALLBACK)


def test_exported_from_public_api():
    assert mlxrunner.Tokenizer is Tokenizer


def test_bytelevel_folder(bytelevel: Tokenizer):
    t = bytelevel
    ids = {n: t.token_to_id(n) for n in ("<|endoftext|>", "<|im_end|>", "<|eot|>")}
    # config.json's int, text_config's list, generation_config's list, tokenizer_config's eos
    assert t.eos_ids == frozenset(ids.values())
    assert isinstance(t.eos_ids, frozenset)
    assert t.eos_token == "<|im_end|>" and t.eos_id == ids["<|im_end|>"]
    assert t.bos_token is None and t.bos_id is None and not t.add_bos_token
    assert t.pad_token == "<|endoftext|>" and t.pad_id == ids["<|endoftext|>"]
    assert set(t.special_tokens) == {
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|eot|>"
    }  # fmt: skip
    assert all(t.token_to_id(k) == v for k, v in t.special_tokens.items())
    assert t.chat_template.startswith("{% for message in messages %}<|im_start|>")
    assert t.vocab_size == 426
    assert t.id_to_token(t.token_to_id("<think>")) == "<think>"
    assert t.id_to_token(10**6) is None and t.token_to_id("no such token") is None
    # no BOS to add: add_special_tokens changes nothing
    assert t.encode("hello", add_special_tokens=True) == t.encode("hello")


def test_bytefallback_folder(bytefallback: Tokenizer):
    t = bytefallback
    assert t.bos_token == "<bos>" and t.bos_id == 2
    assert t.eos_token == "<eos>" and t.eos_id == 1  # written as an AddedToken dict
    assert t.eos_ids == frozenset({1, t.token_to_id("<turn|>")})
    assert t.pad_id == 0 and t.unk_id == 3
    assert t.add_bos_token
    # chat_template is a list of named templates: "default" is picked, all are kept
    assert t.chat_template.startswith("{{ bos_token }}{% for message")
    assert set(t.chat_templates) == {"default", "tool_use"}
    # <|tool_call> is an added token but not special
    assert "<|tool_call>" not in t.special_tokens and "<|turn>" in t.special_tokens


def test_add_bos_token(bytefallback: Tokenizer):
    t = bytefallback
    plain = t.encode("Hello world")
    assert plain[0] != 2
    assert t.encode("Hello world", add_special_tokens=True) == [2, *plain]
    # a prompt that already starts with <bos> does not get a second one
    assert t.encode("<bos>Hello world", add_special_tokens=True) == [2, *plain]
    assert t.encode("", add_special_tokens=True) == [2]


def test_markers_encode_to_single_ids(bytelevel: Tokenizer, bytefallback: Tokenizer):
    t = bytelevel
    ids = t.encode("<|im_start|>user\nhi there<|im_end|>\n<think>x</think>")
    for marker in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert ids.count(t.special_tokens[marker]) == 1
    assert ids[0] == t.special_tokens["<|im_start|>"]
    t = bytefallback
    ids = t.encode("<|turn>user\nhi<turn|><|tool_call>")
    assert ids[0] == 4 and 5 in ids and ids[-1] == t.token_to_id("<|tool_call>")


def test_decode_skip_special_tokens(bytelevel: Tokenizer):
    t = bytelevel
    ids = t.encode("<|im_start|>user\nhi<|im_end|>")
    assert t.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert t.decode(ids, skip_special_tokens=True) == "user\nhi"


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_chat_template_jinja_file_wins(tmp_path: Path):
    folder = copy_folder(BYTEFALLBACK, tmp_path / "m")
    (folder / "chat_template.jinja").write_text("FROM FILE {{ messages }}", encoding="utf-8")
    t = Tokenizer.from_folder(folder)
    assert t.chat_template == "FROM FILE {{ messages }}"


def test_chat_template_list_without_default(tmp_path: Path):
    folder = copy_folder(BYTEFALLBACK, tmp_path / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    t = Tokenizer.from_folder(folder)
    assert t.chat_template is None and dict(t.chat_templates) == {"tool_use": "T"}


def test_minimal_folder_only_tokenizer_json(tmp_path: Path):
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(BYTELEVEL / "tokenizer.json", folder)
    t = Tokenizer.from_folder(folder)
    assert t.eos_ids == frozenset() and t.chat_template is None and t.bos_id is None
    assert t.decode(t.encode("plain text")) == "plain text"


def test_from_file_gz_and_config(tmp_path: Path):
    gz = tmp_path / "tokenizer.json.gz"
    gz.write_bytes(gzip.compress((BYTEFALLBACK / "tokenizer.json").read_bytes()))
    t = Tokenizer.from_file(
        gz, config={"bos_token": "<bos>", "add_bos_token": True}, eos_ids=[5], chat_template="C"
    )
    assert t.bos_id == 2 and t.eos_ids == frozenset({5}) and t.chat_template == "C"
    assert t.encode("hi", add_special_tokens=True)[0] == 2


def one_line_error(excinfo: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_error_missing_folder(tmp_path: Path):
    with pytest.raises(ModelFolderError) as excinfo:
        Tokenizer.from_folder(tmp_path / "nowhere")
    one_line_error(excinfo, "nowhere", "not a folder")


def test_error_missing_tokenizer_json(tmp_path: Path):
    with pytest.raises(ModelFolderError) as excinfo:
        Tokenizer.from_folder(tmp_path)
    one_line_error(excinfo, str(tmp_path / "tokenizer.json"), "not found")


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"model": {"type": "NoSuchModel"}}', b"", b"\xff\xfe garbage"],
    ids=["bad-json", "bad-model", "empty", "binary"],
)
def test_error_corrupt_tokenizer_json(tmp_path: Path, content: bytes):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ModelFolderError) as excinfo:
        Tokenizer.from_folder(tmp_path)
    one_line_error(excinfo, str(tmp_path / "tokenizer.json"))


def test_error_truncated_gz(tmp_path: Path):
    data = gzip.compress((BYTELEVEL / "tokenizer.json").read_bytes())
    path = tmp_path / "tokenizer.json.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFolderError) as excinfo:
        Tokenizer.from_file(path)
    one_line_error(excinfo, str(path))


@pytest.mark.parametrize(
    ("name", "content", "fragments"),
    [
        ("config.json", "{oops", ["config.json", "not valid JSON", "line 1"]),
        ("generation_config.json", "[1, 2]", ["generation_config.json", "JSON object"]),
        ("config.json", '{"eos_token_id": "two"}', ["config.json", "eos_token_id"]),
        ("config.json", '{"text_config": {"eos_token_id": [1, true]}}', ["text_config"]),
        ("tokenizer_config.json", '{"eos_token": "<nope>"}', ["eos_token", "<nope>"]),
        ("tokenizer_config.json", '{"add_bos_token": true}', ["no bos_token"]),
        ("tokenizer_config.json", '{"chat_template": 3}', ["chat_template"]),
        (
            "tokenizer_config.json",
            '{"added_tokens_decoder": {"7": {"content": "<|im_end|>", "special": true}}}',
            ["<|im_end|>", "id 7", "id 422"],
        ),
    ],
)
def test_error_bad_side_files(tmp_path: Path, name: str, content: str, fragments: list[str]):
    folder = copy_folder(BYTELEVEL, tmp_path / "m")
    (folder / name).write_text(content, encoding="utf-8")
    with pytest.raises(ModelFolderError) as excinfo:
        Tokenizer.from_folder(folder)
    one_line_error(excinfo, *fragments)


# ------------------------------------------------------- streaming, tiny tokenizers


def id_sequences(t: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Random ids weighted towards the hard cases: byte tokens, specials, unknown ids."""
    vocab = t.vocab_size
    special = sorted(t.backend.get_added_tokens_decoder())
    byte_like = sorted(t._byte_fallback_ids) or list(range(min(vocab, 256)))
    one = st.one_of(
        st.integers(0, vocab - 1),
        st.sampled_from(byte_like),
        st.sampled_from(special),
        st.integers(vocab, vocab + 3),  # unknown ids: decode() drops them
    )
    return st.lists(one, max_size=40)


@pytest.mark.parametrize("skip", [False, True], ids=["keep-special", "skip-special"])
@pytest.mark.parametrize("which", ["bytelevel", "bytefallback"])
@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_stream_equals_decode_tiny(which: str, skip: bool, data: st.DataObject):
    t = tiny(BYTELEVEL if which == "bytelevel" else BYTEFALLBACK)
    ids = data.draw(id_sequences(t))
    pieces = stream(t, ids, skip)
    assert "".join(pieces) == t.decode(ids, skip_special_tokens=skip)
    if not skip:
        assert_markers_whole(pieces, list(t.special_tokens))


@given(text=st.text(max_size=80))
@settings(max_examples=150, deadline=None)
def test_stream_of_encoded_text_tiny(text: str):
    for t in (tiny(BYTELEVEL), tiny(BYTEFALLBACK)):
        ids = t.encode(text)
        pieces = stream(t, ids)
        assert "".join(pieces) == t.decode(ids)
        if "\ufffd" not in text:
            # valid text never shows a replacement character mid-stream
            assert not any("\ufffd" in p for p in pieces)


def test_stream_holds_incomplete_utf8(bytelevel: Tokenizer, bytefallback: Tokenizer):
    # "☃" is E2 98 83: nothing may come out until its last byte arrives
    for t in (bytelevel, bytefallback):
        ids = t.encode("a☃")
        pieces = stream(t, ids)
        assert "".join(pieces) == "a☃"
        assert "☃" in [p for p in pieces if p][-1]
        assert all("\ufffd" not in p for p in pieces)


def test_stream_byte_run_turned_invalid(bytefallback: Tokenizer):
    t = bytefallback
    b = {v: t.token_to_id(f"<0x{v:02X}>") for v in (0x41, 0xE2, 0x82, 0xAC, 0x80)}
    # E2 82 AC is "€" on its own, but a following stray 0x80 makes the whole run invalid
    ids = [b[0xE2], b[0x82], b[0xAC], b[0x80], t.token_to_id("<eos>")]
    assert t.decode(ids) == "\ufffd" * 4 + "<eos>"
    assert "".join(stream(t, ids)) == t.decode(ids)
    # a skipped special between byte tokens joins the run, as decode() does
    ids = [b[0x41], 1, b[0x80]]
    assert t.decode(ids, skip_special_tokens=True) == "\ufffd\ufffd"
    assert "".join(stream(t, ids, skip_special_tokens=True)) == "\ufffd\ufffd"


def strip_variant(tmp_path: Path, decoder: dict) -> Tokenizer:
    spec = json.loads((BYTEFALLBACK / "tokenizer.json").read_text(encoding="utf-8"))
    spec["decoder"] = decoder
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return Tokenizer.from_file(path)


LLAMA2_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ],
}
METASPACE_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "ByteFallback"},
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
    ],
}


@pytest.mark.parametrize("decoder", [LLAMA2_DECODER, METASPACE_DECODER], ids=["strip", "meta"])
def test_stream_leading_space_decoders(tmp_path: Path, decoder: dict):
    # decoders that drop the first token's leading space: the window must keep context
    t = strip_variant(tmp_path, decoder)
    space = t.encode(" ")[0]
    ids = t.encode(" Hello world") + [space, space] + t.encode(" x  y")
    assert "".join(stream(t, ids)) == t.decode(ids)

    @given(ids=id_sequences(t))
    @settings(max_examples=150, deadline=None)
    def check(ids: list[int]) -> None:
        assert "".join(stream(t, ids)) == t.decode(ids)

    check()


def test_stream_keeps_context_after_empty_token(tmp_path: Path):
    # a token that decodes to "" must not become the window's only context: the
    # Strip would then eat the next token's space, which decode() keeps
    decoder = json.loads(json.dumps(LLAMA2_DECODER))
    decoder["decoders"].insert(
        0, {"type": "Replace", "pattern": {"String": "<pad>"}, "content": ""}
    )
    t = strip_variant(tmp_path, decoder)
    ids = t.encode(" world") + [0] + t.encode(" x")
    assert t.decode(ids) == "world x"
    assert "".join(stream(t, ids)) == "world x"


class CountingBackend:
    """Delegates to a tokenizers.Tokenizer, counting the ids decode() is handed."""

    def __init__(self, inner: tokenizers.Tokenizer) -> None:
        self.inner, self.decoded_ids, self.calls = inner, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("folder", [BYTELEVEL, BYTEFALLBACK], ids=["bytelevel", "bytefallback"])
def test_stream_cost_is_constant_per_token(folder: Path):
    t = Tokenizer.from_folder(folder)
    counting = CountingBackend(t.backend)
    t._backend = counting  # only this test's instance
    ids = t.encode(" ".join(["Hello, world! Привет, мир! 你好 🦙 café"] * 60))
    assert len(ids) > 1000
    pieces = stream(t, ids)
    assert "".join(pieces) == counting.inner.decode(ids, skip_special_tokens=False)
    # two short decodes per id, not the whole sequence (which would be ~n^2/2 ids)
    assert counting.decoded_ids < 20 * len(ids), counting.decoded_ids


def test_finish_ends_the_stream(bytelevel: Tokenizer):
    detok = bytelevel.detokenizer()
    ids = bytelevel.encode("hi")
    assert "".join(detok.add(i) for i in ids) + detok.finish() == "hi"
    assert detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.add(0)


# ------------------------------------------------------------- real tokenizers


def load_real(name: str) -> Tokenizer:
    folder = shared_tokenizers_dir()
    if folder is None:
        pytest.skip(SKIP_REASON)
    path = folder / f"{name}-tokenizer.json.gz"
    if not path.is_file():
        pytest.skip(f"{path} absent from the shared data")
    return Tokenizer.from_file(path)


@pytest.fixture(scope="module")
def gemma4() -> Tokenizer:
    return load_real("gemma4")


@pytest.fixture(scope="module")
def qwen3_5() -> Tokenizer:
    return load_real("qwen3_5")


@pytest.fixture(scope="module")
def special_tokens_json() -> dict:
    folder = shared_tokenizers_dir()
    if folder is None or not (folder / "special_tokens.json").is_file():
        pytest.skip(SKIP_REASON)
    return json.loads((folder / "special_tokens.json").read_text(encoding="utf-8"))


def read_vectors() -> list[tuple[str, list[int]]]:
    folder = shared_tokenizers_dir()
    if folder is None:
        pytest.skip(SKIP_REASON)
    # llama.cpp's format: inputs joined by "\n__ggml_vocab_test__\n" (the last one
    # without a trailing separator); one line of space-separated ids per input.
    inputs = (folder / "gemma4-vectors.inp").read_bytes().decode("utf-8")
    outputs = (folder / "gemma4-vectors.out").read_bytes().decode("utf-8")
    texts = inputs.split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":
        texts.pop()
    lines = outputs.split("\n")
    assert lines[-1] == "", "the .out file ends with a newline"
    lines.pop()
    assert len(texts) == len(lines) == 46
    return [(text, [int(x) for x in line.split()]) for text, line in zip(texts, lines)]


def test_gemma4_vectors(gemma4: Tokenizer):
    vectors = read_vectors()
    failures = [
        (text, gemma4.encode(text), ids) for text, ids in vectors if gemma4.encode(text) != ids
    ]
    assert not failures, failures[:3]
    # the set includes the tricky ones: empty text, lone tabs/newlines, digits
    assert ("", []) in vectors and any(text == "\t" for text, _ in vectors)


def test_real_special_ids(gemma4: Tokenizer, qwen3_5: Tokenizer, special_tokens_json: dict):
    g = special_tokens_json["gemma4"]
    for table in (g["control_tokens"], g["user_defined_tokens_first_200"]):
        for marker, token_id in table.items():
            assert gemma4.encode(marker) == [token_id], marker
            assert gemma4.decode([token_id]) == marker
    assert gemma4.vocab_size == g["vocab_size"]
    q = special_tokens_json["qwen3_5"]
    for marker, token_id in q["added"].items():
        assert qwen3_5.encode(marker) == [token_id], marker
    for text, token_id in q["plain_token_ids_seen_in_tests"].items():
        text = {"\\n": "\n", "Ġis": " is"}.get(text, text)
        assert qwen3_5.encode(text) == [token_id], text
    prompt = "<|im_start|>user\nThis is<|im_end|>\n<|im_start|>assistant\n"
    assert qwen3_5.encode(prompt) == [248045, 846, 198, 1919, 369, 248046, 198, 248045, 74455, 198]


def test_real_folder_roles(gemma4: Tokenizer, special_tokens_json: dict):
    g = special_tokens_json["gemma4"]
    t = Tokenizer(
        gemma4.backend,
        config={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                "unk_token": "<unk>", "add_bos_token": g["add_bos_token"]},
    )  # fmt: skip
    assert (t.bos_id, t.eos_id, t.pad_id, t.unk_id) == (g["bos"], g["eos"], g["pad"], g["unk"])
    assert t.encode("Hello", add_special_tokens=True) == [g["bos"], *gemma4.encode("Hello")]


GEMMA_MARKERS = ["<|turn>", "<turn|>", "<bos>", "<eos>", "<|tool_call>", '<|"|>', "<|channel>"]
QWEN_MARKERS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>"]


# Characters where tokenizers tend to differ: spaces and U+2581, control characters,
# combining marks and what they compose with (e + U+0301, > + U+0338, A + U+030A,
# Hangul jamo), decomposable signs (U+212B), U+FFFD, an emoji and the ZWJ. Plain
# st.text() rarely draws them (a run with it alone missed both normalisations).
TRICKY = (
    " \u2581\t\n\r\x00<>|eA\u0301\u0338\u030a\u212b\u1100\u1161\u11a8\uac00\ufffd\U0001f999\u200d"
)


def texts_with_markers(markers: list[str]) -> st.SearchStrategy[str]:
    """Arbitrary unicode (all code points but surrogates, which cannot be encoded),
    mixed with runs of TRICKY characters and special markers."""
    chunk = st.one_of(
        st.text(max_size=30), st.text(alphabet=TRICKY, max_size=8), st.sampled_from(markers)
    )
    return st.lists(chunk, max_size=6).map("".join)


def gemma4_expected(text: str) -> str:
    return text.replace("\u2581", " ")


def qwen3_5_expected(text: str) -> str:
    pattern = "(" + "|".join(re.escape(m) for m in sorted(QWEN_MARKERS, key=len)[::-1]) + ")"
    parts = re.split(pattern, text)
    return "".join(p if p in QWEN_MARKERS else unicodedata.normalize("NFC", p) for p in parts)


@given(text=texts_with_markers(GEMMA_MARKERS))
@SETTINGS
def test_gemma4_round_trip(gemma4: Tokenizer, text: str):
    assert gemma4.decode(gemma4.encode(text)) == gemma4_expected(text)


@given(text=texts_with_markers(QWEN_MARKERS))
@SETTINGS
def test_qwen3_5_round_trip(qwen3_5: Tokenizer, text: str):
    assert qwen3_5.decode(qwen3_5.encode(text)) == qwen3_5_expected(text)


@pytest.mark.parametrize(
    "text",
    ["", " ", "  leading", "trailing  ", "\x00\x01\x7f", "\r\n\t", "\ufffd", "<0x41>", "<unk>x",
     "e\u0301", "\U0001f999\u200d", "\U0010ffff", "a\u2028b", "<|im_end|>\u0338"],
)  # fmt: skip
def test_round_trip_edge_cases(gemma4: Tokenizer, qwen3_5: Tokenizer, text: str):
    assert gemma4.decode(gemma4.encode(text)) == gemma4_expected(text)
    assert qwen3_5.decode(qwen3_5.encode(text)) == qwen3_5_expected(text)


def test_stated_normalisations(gemma4: Tokenizer, qwen3_5: Tokenizer):
    # each caveat of the module docstring, shown to happen
    assert gemma4.decode(gemma4.encode("a\u2581b")) == "a b"
    assert qwen3_5.decode(qwen3_5.encode("e\u0301")) == "\u00e9"
    assert qwen3_5.decode(qwen3_5.encode("<|im_end|>\u0338")) == "<|im_end|>\u0338"


def real_id_sequences(t: Tokenizer, extra: list[int]) -> st.SearchStrategy[list[int]]:
    one = st.one_of(
        st.integers(0, t.vocab_size - 1),
        st.sampled_from(sorted(t.backend.get_added_tokens_decoder())),
        st.sampled_from(extra),
    )
    return st.lists(one, max_size=40)


@pytest.fixture(scope="module")
def qwen_byte_ids(qwen3_5: Tokenizer) -> list[int]:
    # single-byte tokens of 0x80..0xFF: the pieces of multi-byte characters
    ids = [i for tok, i in qwen3_5.backend.get_vocab().items() if len(tok) == 1]
    return [i for i in ids if qwen3_5.decode([i]) == "\ufffd"]


@given(data=st.data())
@SETTINGS
def test_gemma4_stream_random_ids(gemma4: Tokenizer, data: st.DataObject):
    ids = data.draw(real_id_sequences(gemma4, sorted(gemma4._byte_fallback_ids)))
    skip = data.draw(st.booleans())
    pieces = stream(gemma4, ids, skip)
    assert "".join(pieces) == gemma4.decode(ids, skip_special_tokens=skip)
    if not skip:
        assert_markers_whole(pieces, GEMMA_MARKERS)


@given(data=st.data())
@SETTINGS
def test_qwen3_5_stream_random_ids(qwen3_5: Tokenizer, qwen_byte_ids: list[int], data):
    ids = data.draw(real_id_sequences(qwen3_5, qwen_byte_ids))
    skip = data.draw(st.booleans())
    pieces = stream(qwen3_5, ids, skip)
    assert "".join(pieces) == qwen3_5.decode(ids, skip_special_tokens=skip)
    if not skip:
        assert_markers_whole(pieces, QWEN_MARKERS)


@given(data=st.data())
@SETTINGS
def test_real_stream_of_encoded_text(gemma4: Tokenizer, qwen3_5: Tokenizer, data):
    t, markers = data.draw(st.sampled_from([(gemma4, GEMMA_MARKERS), (qwen3_5, QWEN_MARKERS)]))
    text = data.draw(texts_with_markers(markers))
    ids = t.encode(text)
    pieces = stream(t, ids)
    assert "".join(pieces) == t.decode(ids)
    assert_markers_whole(pieces, markers)
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)
