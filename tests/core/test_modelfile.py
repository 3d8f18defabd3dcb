"""mlxrunner.read_modelfile: Ollama's Modelfile subset, typed PARAMETERs, one-line errors.

Expected values for quoting and trimming follow Ollama's own parser tests
(parser/parser_test.go: TestParseFileQuoted, TestParseFileParameters).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlxrunner
from mlxrunner import Modelfile, ModelfileError, read_modelfile
from mlxrunner.model import PARAMETER_TYPES, inherit_modelfile, parse_modelfile


def write(tmp_path: Path, text: str, name: str = "Modelfile") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


def parse(tmp_path: Path, text: str) -> Modelfile:
    return read_modelfile(write(tmp_path, text))


def test_inherit_fills_what_a_modelfile_leaves_unset_from_its_base(tmp_path: Path):
    (tmp_path / "base").mkdir()
    (tmp_path / "own").mkdir()
    base = parse(tmp_path / "base", 'FROM .\nDRAFT ./draft\nRENDERER jinja\nPARSER qwen3.5\n'
                 'PARAMETER top_k 7\nPARAMETER stop "a"\nSYSTEM "base"\n')
    own = parse(tmp_path / "own", 'FROM ../base\nPARSER gemma4\nPARAMETER top_k 3\n'
                'PARAMETER temperature 0.5\n')
    merged = inherit_modelfile(own, base)
    assert (merged.renderer, merged.parser, merged.system) == ("jinja", "gemma4", "base")
    assert merged.parameters == {"top_k": 3, "temperature": 0.5, "stop": ["a"]}
    # the base's DRAFT is relative to the base's folder, not to this Modelfile's
    assert merged.draft_path == (tmp_path / "base" / "draft").absolute()
    assert merged.draft == str(merged.draft_path) and merged.from_path == base.from_path


def test_exported():
    assert mlxrunner.read_modelfile is read_modelfile and mlxrunner.Modelfile is Modelfile


def test_full_example(tmp_path: Path):
    text = (
        "# a model with a draft\n"
        "\n"
        "FROM ./target\n"
        "draft ../drafts/dflash   \n"
        "  Renderer gemma4-small\n"
        "PARSER gemma4\n"
        "PARAMETER temperature 0.7\n"
        "parameter TOP_K 40\n"
        "PARAMETER top_p .95\n"
        "PARAMETER min_p 5e-2\n"
        "PARAMETER seed -1\n"
        "PARAMETER num_predict 128\n"
        "PARAMETER num_ctx 8192\n"
        "PARAMETER repeat_penalty 1\n"
        "PARAMETER stop <turn|>\n"
        'PARAMETER stop "<|im_end|>"\n'
        "SYSTEM You are terse.\n"
    )
    mf = parse(tmp_path, text)
    assert mf.path == tmp_path / "Modelfile"
    assert mf.from_ == "./target" and mf.from_path == tmp_path / "target"
    assert mf.draft == "../drafts/dflash"
    assert mf.draft_path == Path(str((tmp_path / "../drafts/dflash").absolute()))
    assert mf.renderer == "gemma4-small" and mf.parser == "gemma4"
    assert mf.system == "You are terse."
    assert mf.parameters == {
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
        "seed": -1,
        "num_predict": 128,
        "num_ctx": 8192,
        "repeat_penalty": 1.0,
        "stop": ["<turn|>", "<|im_end|>"],
    }
    types = {k: type(v) for k, v in mf.parameters.items()}
    assert types["top_k"] is int and types["temperature"] is float
    assert types["repeat_penalty"] is float  # "1" for a float parameter is still a float


def test_empty_and_comment_only(tmp_path: Path):
    mf = parse(tmp_path, "# nothing here\n\n   \n\t# indented comment\n")
    assert mf == Modelfile(path=tmp_path / "Modelfile")


def test_paths(tmp_path: Path):
    mf = parse(tmp_path, "FROM /abs/model\nDRAFT ~/draft\n")
    assert mf.from_path == Path("/abs/model")
    assert mf.draft == "~/draft" and mf.draft_path == Path.home() / "draft"
    # a name (as registered through register_models) keeps its raw form too
    assert parse(tmp_path, "FROM default\n").from_ == "default"


def test_crlf_and_bom(tmp_path: Path):
    path = tmp_path / "Modelfile"
    path.write_bytes(b'\xef\xbb\xbfFROM x\r\nSYSTEM """a\r\nb"""\r\nPARAMETER top_k 3\r\n')
    mf = read_modelfile(path)
    assert (mf.from_, mf.system, mf.parameters) == ("x", "a\nb", {"top_k": 3})


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('SYSTEM """\nThis is a\nmultiline system.\n"""', "\nThis is a\nmultiline system.\n"),
        ('SYSTEM """\nThis is a\nmultiline system."""', "\nThis is a\nmultiline system."),
        ('SYSTEM """This is a\nmultiline system."""', "This is a\nmultiline system."),
        ('SYSTEM """This is a multiline system."""', "This is a multiline system."),
        ('SYSTEM """\nwith "quotes".\n"""', '\nwith "quotes".\n'),
        ('SYSTEM """"""', ""),
        ('SYSTEM ""', ""),
        ('SYSTEM "\'"', "'"),
        ('SYSTEM """   padded   """   ', "   padded   "),
        ('SYSTEM "a quoted\nsecond line"', "a quoted\nsecond line"),
        ("SYSTEM   spaces inside are kept  ", "spaces inside are kept"),
        ('SYSTEM """line with trailing blanks  \n  next"""', "line with trailing blanks  \n  next"),
    ],
)
def test_system_forms(tmp_path: Path, body: str, expected: str):
    assert parse(tmp_path, f"FROM x\n{body}\nPARAMETER top_k 1\n").system == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("### User:", "### User:"),
        ("### User: ", "### User:"),
        ('"### User:"', "### User:"),
        ('"### User: "', "### User: "),
        ('"""### User:"""', "### User:"),
        ('"""### User:\n"""', "### User:\n"),
        ("<|endoftext|>", "<|endoftext|>"),
        ("</s>", "</s>"),
    ],
)
def test_stop_forms(tmp_path: Path, value: str, expected: str):
    assert parse(tmp_path, f"PARAMETER stop {value}\n").parameters == {"stop": [expected]}


def test_repeated_parameter_last_wins(tmp_path: Path):
    mf = parse(tmp_path, "PARAMETER temperature 0.1\nPARAMETER temperature 0.9\n")
    assert mf.parameters == {"temperature": 0.9}


def test_bool_parameters_typed_like_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # none of mlxrunner's parameters is a bool today; the typing follows Go's ParseBool
    monkeypatch.setitem(PARAMETER_TYPES, "use_mmap", bool)
    for value, expected in [("true", True), ("T", True), ("1", True), ("FALSE", False)]:
        assert parse(tmp_path, f"PARAMETER use_mmap {value}\n").parameters == {"use_mmap": expected}
    with pytest.raises(ModelfileError, match=r":1: PARAMETER use_mmap needs true or false"):
        parse(tmp_path, "PARAMETER use_mmap yes\n")


def expect_error(tmp_path: Path, text: str, line: int, *fragments: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ModelfileError) as excinfo:
        read_modelfile(path)
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{line}: "), message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.mark.parametrize(
    ("text", "line", "fragments"),
    [
        ("FROM x\n\n# c\nBADCOMMAND y\n", 4, ["unknown instruction 'BADCOMMAND'", "FROM, DRAFT"]),
        ("FROM x\nTEMPLATE {{ .Prompt }}\n", 2, ["TEMPLATE is not supported", "RENDERER"]),
        ("MESSAGE user hi\n", 1, ["MESSAGE is not supported"]),
        ("=FROM x\n", 1, ["expected an instruction", "'=FROM'"]),
        ("FROM=x\n", 1, ["expected an instruction", "'FROM=x'"]),
        ("FROM\n", 1, ["FROM needs a value"]),
        ("FROM x\nDRAFT   \n", 2, ["DRAFT needs a value"]),
        ('FROM ""\n', 1, ["FROM needs a value"]),
        ("RENDERER\n", 1, ["RENDERER needs a value"]),
        ("PARAMETER\n", 1, ["PARAMETER needs a name and a value"]),
        ("PARAMETER temperature\n", 1, ["PARAMETER temperature needs a value"]),
        ("PARAMETER temp=1\n", 1, ["PARAMETER name", "'temp=1'"]),
        ("PARAMETER mirostat 1\n", 1, ["unknown PARAMETER 'mirostat'", "temperature"]),
        ("PARAMETER temperature hot\n", 1, ["temperature needs a number", "'hot'"]),
        ("PARAMETER temperature nan\n", 1, ["temperature needs a number"]),
        ("PARAMETER temperature 1e999\n", 1, ["temperature needs a finite number"]),
        ("PARAMETER temperature 1_0\n", 1, ["temperature needs a number"]),
        ("PARAMETER top_k 1.5\n", 1, ["top_k needs an integer", "'1.5'"]),
        ("PARAMETER seed 1e3\n", 1, ["seed needs an integer"]),
        ('PARAMETER stop ""\n', 1, ["stop needs a non-empty string"]),
        ('FROM x\nSYSTEM """\nnever closed\n', 2, ["unterminated triple-quoted value"]),
        ('FROM x\nSYSTEM """closed twice only"" \n', 2, ["unterminated triple-quoted"]),
        ('SYSTEM "open\nPARAMETER top_k 1\n', 1, ["unterminated quoted value"]),
        ("FROM a\nFROM b\n", 2, ["FROM given twice (first on line 1)"]),
        ('SYSTEM a\nSYSTEM """b"""\n', 2, ["SYSTEM given twice"]),
    ],
)
def test_errors(tmp_path: Path, text: str, line: int, fragments: list[str]):
    expect_error(tmp_path, text, line, *fragments)


def test_error_line_counts_multiline_values(tmp_path: Path):
    text = 'FROM x\nSYSTEM """\none\ntwo\n"""\nPARAMETER top_k many\n'
    expect_error(tmp_path, text, 6, "top_k needs an integer")


def test_error_missing_and_binary_file(tmp_path: Path):
    with pytest.raises(ModelfileError, match=r"Modelfile: no such file$"):
        read_modelfile(tmp_path / "Modelfile")
    path = tmp_path / "Modelfile"
    path.write_bytes(b"FROM x\nSYSTEM \xff\xfe\n")
    with pytest.raises(ModelfileError, match=r"Modelfile:2: not UTF-8 text$"):
        read_modelfile(path)


def test_errors_are_mlxrunner_errors():
    assert issubclass(ModelfileError, mlxrunner.MLXRunnerError)


# A written Modelfile reads back as what was written. Values avoid only what the
# syntax cannot carry: CR (CRLF endings are normalised to LF) and, inside a
# triple-quoted value, the closing delimiter itself.
system_texts = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\r"))
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@given(
    system=system_texts.filter(lambda s: '"""' not in s),
    temperature=finite,
    top_k=st.integers(-(2**40), 2**40),
    stops=st.lists(system_texts.filter(lambda s: s and '"""' not in s), max_size=3),
)
@settings(max_examples=150, deadline=None)
def test_written_modelfile_reads_back(system, temperature, top_k, stops):
    lines = ["FROM ./m", f'SYSTEM """{system}"""', f"PARAMETER temperature {temperature!r}"]
    lines += [f"PARAMETER top_k {top_k}"] + [f'PARAMETER stop """{s}"""' for s in stops]
    mf = parse_modelfile("\n".join(lines) + "\n", base_dir="/base")
    assert mf.system == system
    assert mf.from_path == Path("/base/m")
    expected = {"temperature": temperature, "top_k": top_k}
    if stops:
        expected["stop"] = stops
    assert mf.parameters == expected
    assert math.isfinite(mf.parameters["temperature"])
