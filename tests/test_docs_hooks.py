"""Every example of docs/hooks.md is a working plugin module: each Python block is run as a
module, its hook called with a recording callback, and what it registered is used once
(an architecture builds from a config, a renderer renders, a command runs)."""

from __future__ import annotations

import argparse
import re
import types
from pathlib import Path

import pytest

import mlxrunner

DOC = Path(__file__).resolve().parent.parent / "docs" / "hooks.md"


def examples() -> dict[str, str]:
    """hook name -> the Python block under its heading."""
    text = DOC.read_text()
    found = {}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        name = section.split("(", 1)[0].strip()
        block = re.search(r"```python\n(.*?)```", section, flags=re.S)
        if block:
            found[name] = block.group(1)
    return found


def plugin(source: str) -> types.ModuleType:
    module = types.ModuleType("docs_example")
    module.__file__ = str(DOC)
    exec(compile(source, str(DOC), "exec"), module.__dict__)
    return module


def test_every_hook_has_an_example():
    from mlxrunner.host import PluginHost

    hooks = {h for h in dir(PluginHost(use_entry_points=False).pm.hook)
             if h.startswith("register_")}
    assert set(examples()) == hooks


@pytest.mark.parametrize("hook", sorted(examples()))
def test_the_example_registers_something_that_works(hook, tmp_path, capsys):
    pytest.importorskip({"register_drafts": "mlxrunner_dflash",
                         "register_parsers": "mlxrunner_renderer_qwen3_5",
                         "register_architectures": "mlxrunner_example_architecture"
                         }.get(hook, "mlxrunner"))
    module = plugin(examples()[hook])
    assert getattr(getattr(module, hook), "mlxrunner_impl", None) is not None  # marked
    if hook == "register_commands":
        from mlxrunner.cli import CommandRegistry

        parser = argparse.ArgumentParser()
        commands = CommandRegistry(parser.add_subparsers(dest="command"))
        module.register_commands(commands)
        args = parser.parse_args(["hello", "world"])
        assert commands.handlers["hello"](args) == 0
        assert capsys.readouterr().out == "hello, world\n"
        return
    registered = {}
    getattr(module, hook)(lambda name, obj: registered.setdefault(name, obj))
    assert registered
    for name, obj in registered.items():
        if hook == "register_architectures":
            from mlxrunner_test_support import EXAMPLE_CONFIG

            assert obj(dict(EXAMPLE_CONFIG)).num_layers == EXAMPLE_CONFIG["num_hidden_layers"]
        elif hook == "register_renderers":
            text = obj(mlxrunner.plugin.RenderContext()).render(
                [{"role": "user", "content": "hi"}])
            assert text == "user: hi\nassistant: "
        elif hook == "register_parsers":
            assert obj(mlxrunner.plugin.RenderContext()).parse("done").content == "done"
        elif hook == "register_models":
            assert name == "my-model" and obj.endswith("my-model")
        else:
            assert issubclass(obj, mlxrunner.plugin.DraftModel)
