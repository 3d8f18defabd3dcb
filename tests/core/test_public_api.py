"""The public modules: ``mlxrunner`` (the user API; every name it exported before its
subpackages still resolves), ``mlxrunner.plugin`` and ``mlxrunner.nn`` (plugin authors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlxrunner
import mlxrunner.nn
import mlxrunner.plugin

#: what ``mlxrunner`` exported before the core was split into subpackages
EXPORTED_BEFORE = (
    "hookimpl register registered MLXRunnerError ModelFolderError UnknownNameError PluginError "
    "ModelfileError ConversationError DraftConfigError Model Cache KVCache RingCache "
    "RecurrentCache load_model build_model load Bundle read_config Tokenizer Modelfile "
    "read_modelfile topk_indices attend prepare_attend check_kernel outputs_agree switch_allows "
    "on_cuda constant arange_constant project prepare_topk_indices SamplerOptions Sampler "
    "Distribution SamplerOptionError generate GenerationResult RenderContext Renderer Parser "
    "ParsedMessage ToolCall validate_conversation get_renderer get_parser MarkerScanner "
    "ParseEvents TrimmedText ReplyParser DraftModel DraftSession DraftProposal").split()

USER_API = {"load", "Bundle", "load_model", "build_model", "read_config", "generate",
            "generate_batch",
            "GenerationResult", "SamplerOptions", "SamplerOptionError", "Tokenizer", "Modelfile",
            "read_modelfile", "get_renderer", "get_parser", "errors", "__version__"}


def test_every_name_exported_before_still_resolves() -> None:
    missing = [name for name in EXPORTED_BEFORE if not hasattr(mlxrunner, name)]
    assert missing == []
    namespace: dict = {}
    exec(f"from mlxrunner import {', '.join(EXPORTED_BEFORE)}", namespace)


def test_all_and_dir_list_the_user_api() -> None:
    assert set(mlxrunner.__all__) == USER_API
    assert set(dir(mlxrunner)) == USER_API
    assert mlxrunner.errors.ModelFolderError is mlxrunner.ModelFolderError


def test_plugin_names_are_one_object_under_every_name() -> None:
    """Every name ``mlxrunner`` still resolves for plugins written against its flat API is
    the object the plugin modules export (names added since are there alone)."""
    for module in (mlxrunner.plugin, mlxrunner.nn):
        assert module.__all__
        for name in module.__all__:
            if name in mlxrunner._EXPORTS:
                assert getattr(module, name) is getattr(mlxrunner, name), (module.__name__,
                                                                            name)


def test_building_the_commands_and_marking_hooks_import_no_mlx() -> None:
    code = ("import json, sys\n"
            "from mlxrunner import host\n"
            "from mlxrunner.cli import build_parser\n"
            "from mlxrunner.plugin import hookimpl, register\n"
            "import mlxrunner\n"
            "mlxrunner.hookimpl\n"
            "parser, registry = build_parser()\n"
            "host.host().call_commands_hook(registry)\n"
            "print(json.dumps(sorted(m for m in ('mlx', 'jinja2', 'tokenizers') "
            "if m in sys.modules)))\n")
    env = dict(os.environ, MLXRUNNER_LOAD_PLUGINS="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    assert json.loads(out.stdout) == []


def test_help_with_every_installed_plugin_imports_no_mlx() -> None:
    """``mlxrunner --help`` loads every plugin's hooks (its commands join the parser):
    plugin packages must import no MLX and no model at import time."""
    code = ("import contextlib, io, json, sys\n"
            "from mlxrunner.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n"
            "        main(['--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(json.dumps([sorted(m for m in ('mlx', 'numpy', 'jinja2', 'tokenizers') "
            "if m in sys.modules), sorted(m for m in sys.modules if m.startswith("
            "'mlxrunner_') and m.endswith('.plugin'))]))\n")
    env = {k: v for k, v in os.environ.items() if k != "MLXRUNNER_LOAD_PLUGINS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    heavy, plugins = json.loads(out.stdout)
    assert heavy == []
    assert {"mlxrunner_qwen3_5.plugin", "mlxrunner_gemma4.plugin",
            "mlxrunner_dflash.plugin"} <= set(plugins)  # (they did load)
