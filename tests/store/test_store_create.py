"""``create --quantize`` on the demo's tiny Qwen3.5 target and DFlash2 draft: the entry holds
what quantizing the loaded models with MLX gives (weights and logits exactly), its greedy
output is that of the directly quantized target, and create, list, show, run and rm work on
it through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import mlxrunner
from mlxrunner import SamplerOptions, generate
from mlxrunner.cli import main
from mlxrunner.model import load_draft
from mlxrunner.store import StoreError, default_store

mx.set_default_device(mx.cpu)

PROMPT = "def fibonacci(n):\n    if n < 2:"
#: (mode, bits, group size) of each --quantize name
MODES = {"q4": ("affine", 4, 64), "q8": ("affine", 8, 64), "mxfp4": ("mxfp4", 4, 32),
         "nvfp4": ("nvfp4", 4, 16)}


def quantized_directly(module: nn.Module, name: str) -> nn.Module:
    """``module`` quantized in place with MLX, every quantizable layer whose input width the
    group size divides (what mlx-lm's converter does)."""
    mode, bits, group = MODES[name]
    nn.quantize(module, group_size=group, bits=bits, mode=mode,
                class_predicate=lambda path, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % group == 0)
    return module


def parameters(module: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(module.parameters()))


def assert_same_parameters(got: nn.Module, want: nn.Module) -> None:
    a, b = parameters(got), parameters(want)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert mx.array_equal(a[key], b[key]).item(), key


def greedy(model, tokenizer, draft=None, max_tokens: int = 40) -> list[int]:
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    return generate(model, ids, options=SamplerOptions(temperature=0.0),
                    max_tokens=max_tokens, draft=draft).tokens


def run_cli(capsys, *args: str) -> str:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_create_list_show_run_rm_with_a_quantized_target_and_draft(demo_model, store_root,
                                                                   capsys):
    out = run_cli(capsys, "create", "tiny:q4", "-f", str(demo_model / "Modelfile"),
                  "--quantize", "q4", "--draft-quantize", "q8")
    assert "created tiny:q4 (q4, draft q8" in out

    listing = run_cli(capsys, "list").splitlines()
    assert run_cli(capsys, "ls").splitlines() == listing  # ollama's other name for it
    assert listing[0].split() == ["NAME", "SIZE", "ARCHITECTURE", "PRECISION", "DRAFT",
                                  "MODIFIED"]
    assert listing[1].split()[:1] + listing[1].split()[3:6] == [
        "tiny:q4", "Qwen3_5ForCausalLM", "q4", "q8"]
    [row] = json.loads(run_cli(capsys, "list", "--json"))
    entry = Path(row["path"])
    assert entry.parent == store_root and row["size"] == sum(  # the model's files
        p.stat().st_size for p in entry.rglob("*") if p.is_file() and p.name != "manifest.json")
    # a self-contained folder: weights, draft, tokenizer, Modelfile, config with quantization
    config = json.loads((entry / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert json.loads((entry / "draft" / "config.json").read_text())["quantization"] == {
        "group_size": 64, "bits": 8, "mode": "affine"}
    assert (entry / "tokenizer.json").read_bytes() == (demo_model / "tokenizer.json").read_bytes()
    assert "FROM ." in (entry / "Modelfile").read_text()

    shown = json.loads(run_cli(capsys, "show", "tiny:q4", "--json"))
    assert shown["model"] == "tiny:q4" and shown["folder"] == str(entry)
    assert shown["target_stored_precision"] == "4-bit affine"
    assert shown["draft_stored_precision"] == "8-bit affine"
    assert shown["draft"] == str(entry / "draft")

    # the quantized bundle computes exactly what the directly quantized models compute
    bundle = mlxrunner.load("tiny:q4")
    source = mlxrunner.load(str(demo_model))
    target = quantized_directly(source.model, "q4")
    # the draft quantized as stored (bfloat16), then computing in the target's dtype, as
    # mlxrunner.load builds every draft
    draft = quantized_directly(load_draft(source.draft_path, source.model), "q8")
    draft.set_dtype(source.model.dtype)
    assert_same_parameters(bundle.model, target)
    assert_same_parameters(bundle.draft, draft)
    ids = mx.array([bundle.tokenizer.encode(PROMPT, add_special_tokens=True)])
    assert mx.array_equal(bundle.model(ids), target(ids)).item()
    float_model = mlxrunner.load_model(demo_model)
    assert not mx.allclose(float_model(ids), target(ids), atol=1e-3).item()  # 4 bits show
    want = greedy(target, bundle.tokenizer)
    assert greedy(bundle.model, bundle.tokenizer) == want
    assert greedy(bundle.model, bundle.tokenizer, draft=bundle.draft) == want

    ran = json.loads(run_cli(capsys, "run", "tiny:q4", PROMPT, "--max-tokens", "40",
                             "--json", "--temperature", "0"))
    assert ran["model"] == "tiny:q4" and ran["folder"] == str(entry)
    assert ran["tokens"] == want
    assert ran["statistics"]["run"]["mode"] == "speculative"

    assert run_cli(capsys, "cp", "tiny:q4", "mine/tiny").strip() == \
        "copied 'tiny:q4' to 'mine/tiny'"
    assert [e.name for e in default_store().entries()] == ["mine/tiny", "tiny:q4"]
    assert run_cli(capsys, "rm", "tiny:q4", "mine/tiny").splitlines() == [
        "deleted 'tiny:q4'", "deleted 'mine/tiny'"]
    assert default_store().entries() == [] and not any(store_root.iterdir())
    assert main(["show", "tiny:q4"]) == 1
    assert "unknown model 'tiny:q4'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["q8", "mxfp4", "nvfp4"])
def test_each_quantization_is_what_mlx_gives(demo_model, store_root, name):
    from mlxrunner.store import create

    entry = create(default_store(), f"tiny-{name}", demo_model, quantize=name)
    assert entry.manifest.target_precision == name
    assert entry.manifest.draft_precision == "bfloat16"  # the draft as it was
    loaded = mlxrunner.load_model(entry.path)
    assert loaded.weight_precision == {"q8": "8-bit affine"}.get(name, name)
    target = quantized_directly(mlxrunner.load_model(demo_model), name)
    assert_same_parameters(loaded, target)
    ids = mx.array([[5, 17, 300, 42, 7, 1000]])
    assert mx.array_equal(loaded(ids), target(ids)).item()


def test_create_without_quantizing_copies_the_weights(demo_model, store_root):
    from mlxrunner.store import create

    entry = create(default_store(), "plain", demo_model / "Modelfile")
    assert (entry.path / "model.safetensors").read_bytes() == \
        (demo_model / "model.safetensors").read_bytes()
    assert entry.manifest.target_precision == "bfloat16"
    assert entry.manifest.draft_precision == "bfloat16"


def test_create_refusals_are_one_line_and_leave_the_store_as_it_was(demo_model, store_root,
                                                                    tmp_path, capsys):
    from mlxrunner.store import create

    create(default_store(), "q", demo_model, quantize="q4")
    before = sorted(p.relative_to(store_root) for p in store_root.rglob("*"))
    with pytest.raises(StoreError, match="already quantized \\(q4\\)"):
        create(default_store(), "qq", default_store().path_of("q"), quantize="q8")
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM {demo_model}\nDRAFT {tmp_path / 'nowhere'}\n")
    assert main(["create", "broken", "-f", str(modelfile)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "draft folder not found" in err
    assert main(["create", "../escape", "-f", str(demo_model)]) == 1
    assert "is not a model name" in capsys.readouterr().err
    assert sorted(p.relative_to(store_root) for p in store_root.rglob("*")) == before


def test_the_entry_keeps_the_modelfiles_settings(demo_model, store_root, tmp_path):
    from mlxrunner.store import create

    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f'FROM {demo_model}\nPARAMETER stop "<|im_end|>"\n'
                         'PARAMETER stop "two words"\nPARAMETER top_k 7\n'
                         'SYSTEM """Be brief.\nVery brief."""\n')
    entry = create(default_store(), "set", modelfile)
    made = mlxrunner.read_modelfile(entry.path / "Modelfile")
    assert made.from_ == "." and made.system == "Be brief.\nVery brief."
    assert made.parameters == {"temperature": 0.0, "num_predict": 128, "top_k": 7,
                               "stop": ["<|im_end|>", "two words"]}
    bundle = mlxrunner.load("set")
    assert bundle.stop_strings() == ["<|im_end|>", "two words"]
    assert bundle.draft is not None


def test_rm_cp_and_run_by_name(demo_model, store_root, capsys, monkeypatch):
    assert main(["rm", "absent"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlxrunner: error: absent: no such model in the store") and \
        err.count("\n") == 1
    # cp of a folder that is not in the store makes it an entry
    assert run_cli(capsys, "cp", str(demo_model), "demo-copy").strip() == \
        f"copied '{demo_model}' to 'demo-copy'"
    [entry] = default_store().entries()
    assert entry.manifest.source == {"type": "folder", "path": str(demo_model)}
    assert entry.manifest.architecture == "Qwen3_5ForCausalLM"
    # rm names every model first: one unknown name deletes nothing
    assert main(["rm", "demo-copy", "absent"]) == 1
    assert [e.name for e in default_store().entries()] == ["demo-copy"]
    # a store name alone is the model to run (piped input is then the prompt)
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("def add(a, b):"))
    capsys.readouterr()
    ran = json.loads(run_cli(capsys, "run", "demo-copy", "--max-tokens", "4", "--json"))
    assert ran["model"] == "demo-copy" and ran["prompt_tokens"] > 0
    # as in Ollama, a bare name is also its ":latest" and the reverse
    assert run_cli(capsys, "cp", "demo-copy", "mine:latest").strip() == \
        "copied 'demo-copy' to 'mine:latest'"
    for name in ("mine", "mine:latest", "demo-copy:latest"):
        assert default_store().get(name) is not None, name
    assert default_store().get("mine:v2") is None and default_store().get("min") is None
    ran = json.loads(run_cli(capsys, "run", "mine", "def f():", "--max-tokens", "2", "--json"))
    assert ran["model"] == "mine" and len(ran["tokens"]) == 2
