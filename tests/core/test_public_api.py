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
            "generate_batch", "MediaPrompt", "place_media",
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


def test_nn_lists_layers_only_and_old_plumbing_names_warn() -> None:
    """``mlxrunner.nn`` is the layers; its kernel and trace plumbing is the core's own, but
    a plugin written against the old names still gets them, with a DeprecationWarning."""
    import warnings

    plumbing = {"check_kernel", "host_bound", "host_declined", "host_products",
                "kernel_allowed", "on_cuda", "outputs_agree", "project", "serves",
                "switch_allows", "folded_attention", "prepare_attend"}
    assert not plumbing & set(mlxrunner.nn.__all__)
    assert set(dir(mlxrunner.nn)) == set(mlxrunner.nn.__all__)
    code = ("import warnings, json\n"
            "import mlxrunner.nn as mnn\n"
            "from mlxrunner.nn import kernels\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    same = mnn.check_kernel is kernels.check_kernel\n"
            "print(json.dumps([same, [str(w.message) for w in seen]]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    same, seen = json.loads(out.stdout)
    assert same and seen == ["mlxrunner.nn.check_kernel: internal to the core; kept for "
                             "plugins written before"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in mlxrunner.nn.__all__:  # the layers: no warning
            getattr(mlxrunner.nn, name)


def test_plugin_names_at_the_root_say_where_they_belong_now() -> None:
    code = ("import warnings, json\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    from mlxrunner import KVCache, attend, ModelFolderError, load\n"
            "    import mlxrunner.plugin, mlxrunner.nn\n"
            "    same = (KVCache is mlxrunner.plugin.KVCache, attend is mlxrunner.nn.attend)\n"
            "print(json.dumps([same, sorted(str(w.message) for w in seen)]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    same, seen = json.loads(out.stdout)
    assert same == [True, True]
    assert seen == ["mlxrunner.KVCache: import it from mlxrunner.plugin",
                    "mlxrunner.attend: import it from mlxrunner.nn"]



def test_a_model_may_set_its_capabilities_in_init() -> None:
    """What the Model base declares (eos_token_ids, layer_kv_sources, ...) may be set on the
    instance too, lists included (mlx's Module would file a list in the parameter tree after
    deleting the class's declaration, which fails)."""
    from mlxrunner.plugin import Model

    class Declares(Model):
        def __init__(self, config: dict) -> None:
            super().__init__(config)
            self.eos_token_ids = [7, 8]
            self.layer_kv_sources = [0, 0, 1]
            self.default_renderer = "mine"

    model = Declares({})
    assert model.eos_token_ids == [7, 8] and model.layer_kv_sources == [0, 0, 1]
    assert model.default_renderer == "mine" and model.parameters() == {}
    plain = Model({})
    assert plain.eos_token_ids == () and plain.layer_kv_sources is None
    assert plain.default_renderer is None and plain.supports_taps
