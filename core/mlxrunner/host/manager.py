"""Plugin discovery and the registries plugins fill.

Plugins are found once, lazily, through entry points in the ``mlxrunner`` group.
A plugin whose import or hook raises (``sys.exit()`` included; ``KeyboardInterrupt``
still stops everything) is reported in one warning (logger ``mlxrunner.host``) and
skipped; the rest load. Names are global and the first plugin to register a name keeps
it: a later plugin registering it again is one warning naming both, and that one
registration is skipped. ``MLXRUNNER_LOAD_PLUGINS``
(``mlxrunner.settings.current().load_plugins``: comma-separated distribution or
entry-point names, as ``mlxrunner plugins`` lists them; empty for none) limits which
entry points load; the core's own built-ins always load.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

import pluggy

from ..errors import MLXRunnerError, PluginError, PluginFailedError, UnknownNameError
from ..settings import current as current_settings
from . import hookspecs

log = logging.getLogger("mlxrunner.host")

ENTRY_POINT_GROUP = "mlxrunner"
KINDS = ("architectures", "drafts", "renderers", "parsers", "models")
HOOK_OF_KIND = {kind: f"register_{kind}" for kind in KINDS}
DIRECT = "<mlxrunner.register>"
#: the core's own features, a plugin module like any other (in the chat package: it
#: registers the ``jinja`` renderer), loaded by name as entry points are
BUILTINS_MODULE = "mlxrunner.chat.builtins"
BUILTINS_PLUGIN = "mlxrunner.builtins"
#: the model store's name lookup: the store builds models (it sits above the bundle loader),
#: yet names resolve below it, so it is reached by name, as the built-ins are
STORE_LOOKUP = "mlxrunner.store.lookup:find_model"
STORE_NAMES = "mlxrunner.store.lookup:stored_names"
#: what a plugin's failure is: every exception but KeyboardInterrupt (and GeneratorExit),
#: SystemExit included (a plugin calling sys.exit() must not end every command)
PLUGIN_FAILURES = (Exception, SystemExit)

#: The package that provides each architecture name a published plugin registers: the only
#: names an unknown-architecture hint suggests installing (a folder's own text never is).
KNOWN_ARCHITECTURE_PACKAGES: dict[str, str] = {
    **dict.fromkeys(("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "qwen3_5",
                     "qwen3_5_text"), "mlxrunner-qwen3-5"),
    **dict.fromkeys(("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM", "gemma4",
                     "gemma4_text"), "mlxrunner-gemma4"),
    **dict.fromkeys(("LlamaForCausalLM", "llama", "MistralForCausalLM", "mistral"),
                    "mlxrunner-llama"),
    **dict.fromkeys(("ExampleLlamaForCausalLM", "example_llama"),
                    "mlxrunner-example-architecture"),
}


@dataclass
class PluginInfo:
    name: str
    distribution: str | None
    version: str | None
    hooks: list[str] = field(default_factory=list)


@dataclass
class Registration:
    name: str
    obj: Any
    plugin: str


class PluginHost:
    """One plugin manager plus the registries its hooks fill."""

    def __init__(self, use_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager("mlxrunner")
        self.pm.add_hookspecs(hookspecs)
        self.use_entry_points = use_entry_points
        self.plugins: dict[str, PluginInfo] = {}
        self.warnings: list[str] = []
        self._registries: dict[str, dict[str, Registration]] | None = None
        self._direct: dict[str, dict[str, Registration]] = {kind: {} for kind in KINDS}
        self._discovered = False

    # -- discovery ---------------------------------------------------------
    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        log.warning(message)

    def add_plugin(self, module: Any, name: str, distribution: str | None = None,
                   version: str | None = None) -> None:
        """Register a module or object holding hook implementations (tests use this)."""
        self.pm.register(module, name=name)
        hooks = sorted(impl_name for impl_name in dir(module)
                       if impl_name.startswith("register_") and hasattr(self.pm.hook, impl_name))
        self.plugins[name] = PluginInfo(name, distribution, version, hooks)
        self._registries = None

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        self.add_plugin(import_module(BUILTINS_MODULE), BUILTINS_PLUGIN, "mlxrunner",
                        _version("mlxrunner"))
        if not self.use_entry_points:
            return
        allowed = current_settings().load_plugins
        # normalised name -> as the user wrote it; a plugin loads when its distribution
        # name or its entry-point name is listed
        wanted = None if allowed is None else {_norm(n): n for n in allowed}
        seen: set[str] = {_norm("mlxrunner"), _norm(BUILTINS_PLUGIN)}  # the built-ins
        installed: list[str] = []
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            if ep.value in (BUILTINS_MODULE, BUILTINS_PLUGIN):  # (its old module path)
                continue
            names = {_norm(ep.name)} | ({_norm(dist)} if dist else set())
            seen |= names
            installed.append(f"{ep.name} ({dist})" if dist and dist != ep.name else ep.name)
            if wanted is not None and not names & wanted.keys():
                continue
            try:
                module = ep.load()
            except PLUGIN_FAILURES as exc:  # a broken plugin must not take the others down
                self._warn(f"plugin {ep.name!r} ({dist}) failed to import: "
                           f"{_failure(exc)}; skipped")
                continue
            try:
                self.add_plugin(module, ep.name, dist, version)
            except PLUGIN_FAILURES as exc:
                self._warn(f"plugin {ep.name!r} ({dist}) could not be registered: "
                           f"{_failure(exc)}; skipped")
        unknown = sorted(name for key, name in (wanted or {}).items() if key not in seen)
        if unknown:
            self._warn(f"MLXRUNNER_LOAD_PLUGINS: no installed plugin is named "
                       f"{' or '.join(map(repr, unknown))} (installed: "
                       f"{', '.join(installed) or 'none'})")

    def describe(self, plugin: str) -> str:
        """A plugin as messages name it: ``'entry-point' (distribution)``."""
        if plugin == DIRECT:
            return "mlxrunner.register()"
        info = self.plugins.get(plugin)
        if info is not None and info.distribution and info.distribution != plugin:
            return f"{plugin!r} ({info.distribution})"
        return repr(plugin)

    def distribution_of(self, plugin: str) -> str:
        """The distribution a plugin came in (its name when unknown)."""
        info = self.plugins.get(plugin)
        return info.distribution if info is not None and info.distribution else plugin

    # -- registries --------------------------------------------------------
    def registry(self, kind: str) -> dict[str, Registration]:
        if kind not in KINDS:
            raise ValueError(f"unknown registry kind {kind!r}")
        if self._registries is None:
            self._discover()
            self._registries = self._collect()
        return dict(self._registries[kind])

    def _collect(self) -> dict[str, dict[str, Registration]]:
        """Every plugin's registrations, in load order: the first to register a name keeps
        it (``mlxrunner.register`` calls made before come first)."""
        registries: dict[str, dict[str, Registration]] = {
            kind: dict(self._direct[kind]) for kind in KINDS}
        for kind in KINDS:
            caller = getattr(self.pm.hook, HOOK_OF_KIND[kind])
            for impl in caller.get_hookimpls():
                plugin = impl.plugin_name
                found: dict[str, Registration] = {}

                def register(name: str, obj: Any, _found=found, _plugin=plugin) -> None:
                    if not isinstance(name, str) or not name:
                        raise PluginError(f"plugin {_plugin!r} registered an empty name")
                    if name in _found:
                        raise PluginError(f"plugin {_plugin!r} registered {name!r} twice")
                    _found[name] = Registration(name, obj, _plugin)

                try:
                    impl.function(register)
                except PLUGIN_FAILURES as exc:
                    self._warn(f"plugin {plugin!r} failed in {HOOK_OF_KIND[kind]}: "
                               f"{_failure(exc)}; skipped")
                    continue
                for name, reg in found.items():
                    owner = registries[kind].get(name)
                    if owner is not None:
                        first = self.describe(owner.plugin)
                        self._warn(f"{kind[:-1]} {name!r} is registered by both {first} and "
                                   f"{self.describe(plugin)}; the name stays with {first} "
                                   "(the later registration is skipped)")
                        continue
                    registries[kind][name] = reg
            for name, reg in self._direct[kind].items():  # registered while hooks ran
                registries[kind].setdefault(name, reg)
        return registries

    def register_direct(self, kind: str, name: str, obj: Any) -> None:
        """``mlxrunner.register``: a name no plugin owns (PluginError at once, naming the
        plugin that does); registering a name again this way replaces the earlier object."""
        if not isinstance(name, str) or not name:
            raise PluginError(f"mlxrunner.register: the name must be a non-empty string, "
                              f"not {name!r}")
        owner = self.registry(kind).get(name)  # loads the plugins first
        if owner is not None and owner.plugin != DIRECT:
            raise PluginError(f"{kind[:-1]} {name!r} is already registered by plugin "
                              f"{self.describe(owner.plugin)}: register yours under another "
                              "name (or leave that plugin out with MLXRUNNER_LOAD_PLUGINS)")
        reg = Registration(name, obj, DIRECT)
        self._direct[kind][name] = reg
        if self._registries is not None:
            self._registries[kind][name] = reg

    def plugin_list(self) -> list[PluginInfo]:
        self._discover()
        return list(self.plugins.values())

    def call_commands_hook(self, cli: Any) -> None:
        """Each plugin's ``register_commands(cli)``, in load order. A command whose name is
        taken (by a built-in or an earlier plugin), or whose arguments fail to build, is one
        warning and skipped; the plugin's other commands stay."""
        self._discover()
        for impl in self.pm.hook.register_commands.get_hookimpls():
            plugin = impl.plugin_name
            try:
                impl.function(_PluginCommands(self, cli, plugin))
            except PLUGIN_FAILURES as exc:
                self._warn(f"plugin {plugin!r} failed in register_commands: "
                           f"{_failure(exc)}; skipped")


class _PluginCommands:
    """What one plugin's ``register_commands`` is handed: the CLI's command registry, each
    command added under the plugin's name so that a clash names both plugins."""

    def __init__(self, host: PluginHost, cli: Any, plugin: str) -> None:
        self._host, self._cli, self._plugin = host, cli, plugin

    def command(self, name: str, help: str, add_arguments: Callable[[Any], None],
                run: Callable[[Any], int | None]) -> None:
        try:
            self._cli.command(name, help, add_arguments, run,
                              plugin=self._host.describe(self._plugin))
        except PluginError as exc:  # the name is taken: the message names both
            self._host._warn(str(exc))
        except PLUGIN_FAILURES as exc:
            self._host._warn(f"plugin {self._plugin!r} failed to add command {name!r}: "
                             f"{_failure(exc)}; skipped")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cli, name)


def _failure(exc: BaseException) -> str:
    """An exception as one line of a warning."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _norm(name: str) -> str:
    """A distribution or entry-point name, normalised (PEP 503: case, runs of - _ .)."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


_host: PluginHost | None = None


def host() -> PluginHost:
    """The process-wide plugin host, created on first use."""
    global _host
    if _host is None:
        _host = PluginHost()
    return _host


def reset(new_host: PluginHost | None = None) -> PluginHost:
    """Replace the process-wide host (tests use this to start from a clean slate)."""
    global _host
    _host = new_host if new_host is not None else PluginHost()
    return _host


def register(name: str, model_class: type) -> None:
    """Register a target architecture from unpackaged code (a notebook, a test): it feeds
    the registry plugins fill.

    A name an installed plugin already registers is refused at once with a
    :class:`~mlxrunner.errors.PluginError` naming that plugin (as pytest refuses a plugin
    name taken twice): a plugin's architecture is never replaced behind its back. Calling
    ``register`` again with a name registered this way replaces the earlier class (re-running
    a notebook cell works). Plugins are loaded by the first call, so the check sees them.
    """
    host().register_direct("architectures", name, model_class)


def lookup(kind: str, name: str, suggestion: str | None = None) -> Registration:
    reg = host().registry(kind).get(name)
    if reg is None:
        available = ", ".join(sorted(host().registry(kind))) or "none"
        hint = f"; {suggestion}" if suggestion else ""
        raise UnknownNameError(f"unknown {kind[:-1]} {name!r} (installed: {available}){hint}")
    return reg


def registered(kind: str) -> dict[str, Registration]:
    """Everything registered of one kind (``architectures``, ``drafts``, ``renderers``,
    ``parsers``, ``models``): name -> Registration(name, obj, plugin)."""
    return dict(host().registry(kind))


def names(kind: str) -> list[str]:
    return sorted(host().registry(kind))


def architecture_for(config: dict[str, Any]) -> type:
    """The registered class for a parsed config.json: ``architectures[0]``, then ``model_type``."""
    archs = config.get("architectures")
    archs = archs[:1] if isinstance(archs, list) else []
    keys = [key for key in (*archs, config.get("model_type")) if isinstance(key, str) and key]
    registry = host().registry("architectures")
    for key in keys:
        if key in registry:
            return registry[key].obj
    wanted = keys[0] if keys else None
    shown = repr(wanted) if wanted is None or len(wanted) <= 60 else repr(wanted[:60]) + "..."
    installed = ", ".join(sorted(registry)) or "none"
    package = next((KNOWN_ARCHITECTURE_PACKAGES[k] for k in keys
                    if k in KNOWN_ARCHITECTURE_PACKAGES), None)
    hint = (f"`pip install {package}` provides it" if package is not None else
            "no known plugin provides it (`mlxrunner architectures` lists the installed ones)")
    raise UnknownNameError(f"unknown architecture {shown} (installed: {installed}); {hint}")


@contextmanager
def plugin_code(kind: str, name: str | None) -> Iterator[None]:
    """Run the code of what a plugin registered (a renderer's ``render``, a parser's
    ``feed``) inside ``with plugin_code("renderers", name):``. Any failure but an
    :class:`~mlxrunner.errors.MLXRunnerError` (the plugin's own one-line error, e.g. a
    ConversationError) or KeyboardInterrupt becomes one
    :class:`~mlxrunner.errors.PluginFailedError` line naming the object and its plugin:
    ``renderer 'gemma4' (plugin mlxrunner-renderer-gemma4) failed: ValueError: ...``."""
    try:
        yield
    except MLXRunnerError:
        raise
    except PLUGIN_FAILURES as exc:
        the_host = host()
        reg = the_host.registry(kind).get(name) if name is not None else None
        owner = f" (plugin {the_host.distribution_of(reg.plugin)})" if reg is not None else ""
        raise PluginFailedError(f"{kind[:-1]} {name!r}{owner} failed: "
                                f"{_failure(exc)}") from exc


def import_object(spec: str) -> Any:
    """``module:attr`` to the object (used for lazily named factories)."""
    module, _, attr = spec.partition(":")
    obj = import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


def find_model(name: str) -> Any:
    """The folder (a Path) of the store's model ``name``, pulling a registered source on first
    use; None when the store knows no such name (see :mod:`mlxrunner.store`)."""
    return import_object(STORE_LOOKUP)(name)


def stored_names() -> list[str]:
    """The names the store holds (none when it cannot be read)."""
    names: list[str] = import_object(STORE_NAMES)()
    return names


def iter_registrations(kind: str) -> Iterable[Registration]:
    return host().registry(kind).values()


Factory = Callable[..., Any]
