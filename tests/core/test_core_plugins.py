"""The plugin host: registration, conflicts, failure isolation, MLXRUNNER_LOAD_PLUGINS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import mlxrunner
import mlxrunner.plugin
from mlxrunner import host as plugins
from mlxrunner.errors import PluginError, UnknownNameError
from mlxrunner_test_support import logged


@pytest.fixture
def host():
    previous = plugins.host()
    h = plugins.reset(plugins.PluginHost(use_entry_points=False))
    yield h
    plugins.reset(previous)


def make_plugin(**hooks):
    module = types.SimpleNamespace()
    for name, fn in hooks.items():
        setattr(module, name, mlxrunner.plugin.hookimpl(fn))
    return module


def test_builtins_register_the_jinja_renderer(host):
    assert plugins.lookup("renderers", "jinja").plugin == "mlxrunner.builtins"


def test_registers_through_the_callback(host):
    class A:
        pass

    host.add_plugin(make_plugin(register_architectures=lambda register: register("AForLM", A)),
                    "a-plugin")
    assert plugins.architecture_for({"architectures": ["AForLM"]}) is A
    assert plugins.architecture_for({"architectures": ["Other"], "model_type": "AForLM"}) is A
    assert host.plugins["a-plugin"].hooks == ["register_architectures"]


def test_a_name_two_plugins_register_stays_with_the_first_and_warns_once(host, caplog):
    first, second = object(), object()
    host.add_plugin(make_plugin(register_renderers=lambda register: register("same", first)),
                    "first", "mlxrunner-first")
    host.add_plugin(make_plugin(register_renderers=lambda register: (
        register("same", second), register("own", second))), "second")
    assert plugins.names("renderers") == ["jinja", "own", "same"]  # every command still works
    assert plugins.lookup("renderers", "same").obj is first
    assert plugins.lookup("renderers", "own").plugin == "second"  # the rest of it registered
    err = logged(caplog).strip().splitlines()
    assert len(err) == 1, err
    assert "'same'" in err[0] and "'first' (mlxrunner-first)" in err[0] and "'second'" in err[0]
    assert err[0].index("'first'") < err[0].index("'second'")


def test_a_command_name_taken_is_skipped_with_one_warning_naming_both(host, caplog):
    from mlxrunner.cli import build_parser

    def commands(*names):
        def hook(cli):
            for name in names:
                cli.command(name, f"{name} help", lambda parser: None, lambda args: 7)
        return hook

    def broken_arguments(parser):
        parser.add_argument("--x")
        raise RuntimeError("bad arguments")

    host.add_plugin(make_plugin(register_commands=commands("hello")), "one")
    host.add_plugin(make_plugin(register_commands=lambda cli: (
        cli.command("half", "half help", broken_arguments, lambda args: 0),
        commands("run", "hello", "mine")(cli))), "two", "mlxrunner-two")
    parser, registry = build_parser()
    plugins.host().call_commands_hook(registry)
    assert registry.owners["hello"] == "'one'" and registry.owners["run"] == "mlxrunner"
    assert registry.owners["mine"] == "'two' (mlxrunner-two)"  # its other command stays
    assert "half" not in registry.handlers
    with pytest.raises(SystemExit):  # the half-built command is gone from the parser too
        parser.parse_args(["half"])
    err = logged(caplog).strip().splitlines()
    assert len(err) == 3, err
    assert "'half'" in err[0] and "'two'" in err[0] and "bad arguments" in err[0]
    assert "'run'" in err[1] and "mlxrunner and 'two' (mlxrunner-two)" in err[1]
    assert "'hello'" in err[2] and "'one' and 'two' (mlxrunner-two)" in err[2]


def test_a_failing_hook_is_skipped_and_the_rest_load(host, caplog):
    def broken(register):
        register("half", object)
        raise RuntimeError("boom")

    host.add_plugin(make_plugin(register_architectures=broken), "broken")
    good = make_plugin(register_architectures=lambda register: register("Good", object))
    host.add_plugin(good, "good")
    assert plugins.names("architectures") == ["Good"]  # nothing half-registered
    err = logged(caplog)
    assert "'broken'" in err and "boom" in err and len(err.strip().splitlines()) == 1


def test_direct_register_feeds_the_same_registry(host):
    class B:
        pass

    mlxrunner.plugin.register("BDirect", B)
    assert plugins.architecture_for({"architectures": ["BDirect"]}) is B


def test_direct_register_over_a_plugins_name_fails_at_once_naming_it(host):
    class Mine:
        pass

    theirs = make_plugin(register_architectures=lambda register: register("Taken", object))
    host.add_plugin(theirs, "their-plugin", "mlxrunner-theirs")
    with pytest.raises(PluginError) as info:
        mlxrunner.plugin.register("Taken", Mine)
    assert "'Taken'" in str(info.value) and "'their-plugin' (mlxrunner-theirs)" in str(info.value)
    # nothing changed, and later lookups keep working
    assert plugins.lookup("architectures", "Taken").plugin == "their-plugin"
    assert plugins.names("architectures") == ["Taken"]


def test_direct_register_again_replaces_its_own_earlier_class(host):
    class Old:
        pass

    class New:
        pass

    mlxrunner.plugin.register("Cell", Old)
    mlxrunner.plugin.register("Cell", New)  # a notebook cell run twice
    assert plugins.architecture_for({"architectures": ["Cell"]}) is New


def test_a_plugin_added_after_a_direct_register_leaves_the_name_to_it(host, caplog):
    class Mine:
        pass

    mlxrunner.plugin.register("Early", Mine)
    host.add_plugin(make_plugin(register_architectures=lambda register: register("Early", 1)),
                    "late")
    assert plugins.lookup("architectures", "Early").obj is Mine
    err = logged(caplog)
    assert "'Early'" in err and "mlxrunner.register()" in err and "'late'" in err


def test_a_plugin_calling_sys_exit_in_a_hook_is_skipped_and_named(host, caplog):
    def exits(register):
        sys.exit(3)

    host.add_plugin(make_plugin(register_renderers=exits), "quitter")
    host.add_plugin(make_plugin(register_renderers=lambda register: register("ok", object)),
                    "fine")
    assert plugins.names("renderers") == ["jinja", "ok"]
    err = logged(caplog).strip().splitlines()
    assert len(err) == 1 and "'quitter'" in err[0] and "sys.exit(3)" in err[0], err


def test_keyboard_interrupt_in_a_hook_still_stops(host):
    def interrupted(register):
        raise KeyboardInterrupt

    host.add_plugin(make_plugin(register_renderers=interrupted), "interrupted")
    with pytest.raises(KeyboardInterrupt):
        plugins.names("renderers")


def test_load_plugins_is_read_from_the_settings(monkeypatch):
    """The switch comes from mlxrunner.settings, not from os.environ at discovery."""
    from mlxrunner import settings

    previous = plugins.host()
    monkeypatch.delenv("MLXRUNNER_LOAD_PLUGINS", raising=False)
    try:
        with settings.overridden(load_plugins=()):
            listed = [p.name for p in plugins.reset().plugin_list()]
        assert listed == ["mlxrunner.builtins"]
    finally:
        plugins.reset(previous)


def test_unknown_architecture_suggests_only_known_packages(host):
    known = make_plugin(register_architectures=lambda register: register("Known", object))
    host.add_plugin(known, "k")
    with pytest.raises(UnknownNameError) as info:
        plugins.architecture_for({"architectures": ["FooForCausalLM"], "model_type": "foo_bar"})
    message = str(info.value)
    assert "FooForCausalLM" in message and "Known" in message
    assert "pip install" not in message and "no known plugin provides it" in message
    with pytest.raises(UnknownNameError) as info:
        plugins.architecture_for({"architectures": ["Gemma4ForConditionalGeneration"]})
    assert "`pip install mlxrunner-gemma4`" in str(info.value)
    with pytest.raises(UnknownNameError) as info:  # not names: no lookup, no crash
        plugins.architecture_for({"architectures": "Gemma4", "model_type": {"a": 1}})
    assert "unknown architecture None" in str(info.value)


def test_known_architecture_packages_match_the_first_party_plugins():
    from mlxrunner_example_architecture import plugin as example
    from mlxrunner_gemma4 import plugin as gemma4
    from mlxrunner_llama import plugin as llama
    from mlxrunner_qwen3_5 import plugin as qwen3_5

    table = plugins.KNOWN_ARCHITECTURE_PACKAGES
    for names, package in ((qwen3_5.NAMES, "mlxrunner-qwen3-5"),
                           (gemma4.ARCHITECTURE_NAMES, "mlxrunner-gemma4"),
                           (llama.ARCHITECTURE_NAMES, "mlxrunner-llama"),
                           (example.ARCHITECTURE_NAMES, "mlxrunner-example-architecture")):
        assert {name: table.get(name) for name in names} == dict.fromkeys(names, package)


def _fake_distribution(site: Path, dist: str, module: str, source: str,
                       entry_point: str | None = None) -> None:
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[mlxrunner]\n{entry_point or dist} = {module}\n")
    (site / f"{module}.py").write_text(source)


def _cli(args, env_extra, tmp_path):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-m", "mlxrunner.cli", *args], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)


GOOD_PLUGIN = """
import mlxrunner.plugin

@mlxrunner.plugin.hookimpl
def register_renderers(register):
    register("fake-good", lambda context: None)
"""


def test_a_plugin_that_raises_on_import_is_named_and_others_work(tmp_path):
    site = tmp_path / "site"
    _fake_distribution(site, "fake-broken", "fake_broken_plugin", "raise ImportError('nope')\n")
    _fake_distribution(site, "fake-good", "fake_good_plugin", GOOD_PLUGIN)
    env = {"PYTHONPATH": str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MLXRUNNER_LOAD_PLUGINS", None)
    result = _cli(["renderers", "--json"], env, tmp_path)
    assert result.returncode == 0, result.stderr
    names = {r["name"] for r in json.loads(result.stdout)}
    assert {"fake-good", "jinja"} <= names
    warning = [line for line in result.stderr.splitlines() if "fake-broken" in line]
    assert len(warning) == 1, result.stderr
    assert "failed to import" in warning[0] and "nope" in warning[0]

    listing = json.loads(_cli(["plugins"], env, tmp_path).stdout)
    good = [p for p in listing if p["distribution"] == "fake-good"]
    assert good and good[0]["version"] == "0.1" and good[0]["hooks"] == ["register_renderers"]


def test_load_plugins_env_limits_loading(tmp_path):
    site = tmp_path / "site"
    _fake_distribution(site, "fake-good", "fake_good_plugin", GOOD_PLUGIN)
    base = {"PYTHONPATH": str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    none = json.loads(_cli(["plugins"], {**base, "MLXRUNNER_LOAD_PLUGINS": ""}, tmp_path).stdout)
    assert [p["plugin"] for p in none] == ["mlxrunner.builtins"]
    only = json.loads(_cli(["plugins"], {**base, "MLXRUNNER_LOAD_PLUGINS": "fake-good"},
                           tmp_path).stdout)
    assert {p["distribution"] for p in only} == {"mlxrunner", "fake-good"}


def _site_env(site: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_load_plugins_takes_entry_point_and_distribution_names(tmp_path):
    """`mlxrunner plugins` prints entry-point names: MLXRUNNER_LOAD_PLUGINS takes those as
    well as distribution names (any case, - or _)."""
    site = tmp_path / "site"
    _fake_distribution(site, "mlxrunner-fake-good", "fake_good_plugin", GOOD_PLUGIN,
                       entry_point="fake-short")
    for value in ("fake-short", "mlxrunner-fake-good", "MLXRunner_Fake_Good", " fake-short ,"):
        result = _cli(["plugins"], {**_site_env(site), "MLXRUNNER_LOAD_PLUGINS": value},
                      tmp_path)
        assert result.returncode == 0, result.stderr
        listing = json.loads(result.stdout)
        assert [p["plugin"] for p in listing] == ["mlxrunner.builtins", "fake-short"], value
        assert result.stderr == "", (value, result.stderr)


def test_load_plugins_naming_nothing_installed_warns_once(tmp_path):
    site = tmp_path / "site"
    _fake_distribution(site, "mlxrunner-fake-good", "fake_good_plugin", GOOD_PLUGIN,
                       entry_point="fake-short")
    result = _cli(["plugins"], {**_site_env(site), "MLXRUNNER_LOAD_PLUGINS": "fake-shrot"},
                  tmp_path)
    assert result.returncode == 0, result.stderr
    assert [p["plugin"] for p in json.loads(result.stdout)] == ["mlxrunner.builtins"]
    warning = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warning) == 1 and "'fake-shrot'" in warning[0], result.stderr
    assert "fake-short (mlxrunner-fake-good)" in warning[0]


EXITING_HOOK = """
import sys
import mlxrunner.plugin

@mlxrunner.plugin.hookimpl
def register_renderers(register):
    sys.exit(4)
"""


def test_a_plugin_calling_sys_exit_is_named_and_skipped_and_others_work(tmp_path):
    site = tmp_path / "site"
    _fake_distribution(site, "fake-exit-import", "fake_exit_import", "import sys\nsys.exit()\n")
    _fake_distribution(site, "fake-exit-hook", "fake_exit_hook", EXITING_HOOK)
    _fake_distribution(site, "fake-good", "fake_good_plugin", GOOD_PLUGIN)
    env = _site_env(site)
    env.pop("MLXRUNNER_LOAD_PLUGINS", None)
    result = _cli(["renderers", "--json"], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "fake-good" in {r["name"] for r in json.loads(result.stdout)}
    for dist, needle in (("fake-exit-import", "failed to import: called sys.exit(None)"),
                         ("fake-exit-hook", "failed in register_renderers: called sys.exit(4)")):
        lines = [line for line in result.stderr.splitlines() if dist in line]
        assert len(lines) == 1 and needle in lines[0], result.stderr


def test_keyboard_interrupt_at_a_plugins_import_still_stops(tmp_path):
    site = tmp_path / "site"
    _fake_distribution(site, "fake-interrupt", "fake_interrupt", "raise KeyboardInterrupt\n")
    result = _cli(["plugins"], {**_site_env(site), "MLXRUNNER_LOAD_PLUGINS": "fake-interrupt"},
                  tmp_path)
    assert result.returncode == 130, (result.returncode, result.stderr)


BROKEN_RENDERER = """
import mlxrunner.plugin

class Broken:
    def render(self, messages, tools=None, *, think=None, add_generation_prompt=True):
        raise ValueError("no template for this")

class Plain:
    def render(self, messages, tools=None, *, think=None, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)

@mlxrunner.plugin.hookimpl
def register_renderers(register):
    register("fake-broken", lambda context: Broken())
    register("fake-plain", lambda context: Plain())
"""


def test_a_renderer_that_raises_is_one_line_naming_it_and_its_plugin(tmp_path):
    site = tmp_path / "site"
    _fake_distribution(site, "mlxrunner-fake-render", "fake_render_plugin", BROKEN_RENDERER,
                       entry_point="fake-render")
    conversation = tmp_path / "c.json"
    conversation.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    env = _site_env(site)
    env.pop("MLXRUNNER_LOAD_PLUGINS", None)
    result = _cli(["render", str(conversation), "--renderer", "fake-broken"], env, tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        "mlxrunner: error: renderer 'fake-broken' (plugin mlxrunner-fake-render) failed: "
        "ValueError: no template for this"]
    debug = _cli(["--debug", "render", str(conversation), "--renderer", "fake-broken"], env,
                 tmp_path)
    assert debug.returncode != 0 and "Traceback" in debug.stderr  # --debug shows where


def test_a_failing_renderer_or_parser_names_itself_through_the_python_api(host):
    from mlxrunner.errors import ConversationError, PluginFailedError

    class Renderer:
        def render(self, messages, tools=None, *, think=None, add_generation_prompt=True):
            if messages[0]["content"] == "exit":
                sys.exit(1)
            raise ConversationError("a conversation problem stays what it is")

    def broken_parser(context):
        raise KeyError("state")

    host.add_plugin(make_plugin(
        register_renderers=lambda register: register("r", lambda context: Renderer()),
        register_parsers=lambda register: register("p", broken_parser)), "chatty",
        "mlxrunner-chatty")
    with pytest.raises(PluginFailedError) as info:
        mlxrunner.get_parser("p")
    assert str(info.value) == "parser 'p' (plugin mlxrunner-chatty) failed: KeyError: 'state'"
    assert isinstance(info.value.__cause__, KeyError)
    renderer = mlxrunner.get_renderer("r")
    with pytest.raises(PluginFailedError, match=r"renderer 'r' .*sys.exit\(1\)"):
        with plugins.plugin_code("renderers", "r"):
            renderer.render([{"role": "user", "content": "exit"}])
    with pytest.raises(ConversationError, match="stays what it is"):
        with plugins.plugin_code("renderers", "r"):
            renderer.render([{"role": "user", "content": "x"}])
    with pytest.raises(KeyboardInterrupt):
        with plugins.plugin_code("renderers", "r"):
            raise KeyboardInterrupt


BROKEN_PARSER = """
import mlxrunner.plugin

class Broken:
    def reset(self, prompt=None, *, start_in_thinking=None, tools=None):
        pass

    def feed(self, chunk):
        raise RuntimeError("cannot feed")

    def finish(self):
        return []

    def parse(self, text):
        raise RuntimeError("cannot parse")

@mlxrunner.plugin.hookimpl
def register_parsers(register):
    register("fake-broken", lambda context: Broken())
"""


def test_run_names_a_failing_renderer_or_parser_in_one_line(tmp_path):
    pytest.importorskip("mlxrunner_example_architecture")
    from mlxrunner_test_support import write_model_folder

    site = tmp_path / "site"
    _fake_distribution(site, "mlxrunner-fake-render", "fake_render_plugin", BROKEN_RENDERER)
    _fake_distribution(site, "mlxrunner-fake-parse", "fake_parse_plugin", BROKEN_PARSER)
    folder = write_model_folder(tmp_path / "model")
    env = _site_env(site)
    env.pop("MLXRUNNER_LOAD_PLUGINS", None)
    short = ["--max-tokens", "2", "--temperature", "0"]
    for args, stdin, expected in (
            (["--json", "--parser", "fake-broken"], None,
             "parser 'fake-broken' (plugin mlxrunner-fake-parse) failed: RuntimeError: "
             "cannot parse"),
            (["--chat", "--parser", "fake-broken", "--renderer", "fake-plain"], "hi\n",
             "parser 'fake-broken' (plugin mlxrunner-fake-parse) failed: RuntimeError: "
             "cannot feed"),
            (["--chat", "--renderer", "fake-broken"], "hi\n",
             "renderer 'fake-broken' (plugin mlxrunner-fake-render) failed: ValueError: "
             "no template for this"),
            (["--renderer", "fake-broken"], None,
             "renderer 'fake-broken' (plugin mlxrunner-fake-render) failed: ValueError: "
             "no template for this")):
        prompt = [] if stdin else ["def add"]
        result = subprocess.run(
            [sys.executable, "-m", "mlxrunner.cli", "run", str(folder), *prompt, *short, *args],
            input=stdin or "", capture_output=True, text=True, env={**os.environ, **env},
            cwd=tmp_path, timeout=300)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert errors == [f"mlxrunner: error: {expected}"], (args, result.stderr)
