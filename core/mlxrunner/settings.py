"""Every switch mlxrunner reads, in one object, read once.

Switches come from the environment (``MLXRUNNER_*``) the first time :func:`current` is asked,
or from the command line (``--no-compile``, ...), which :func:`configure` applies before any
work. Code reads ``current().name``, never ``os.environ``: a switch that changed after start
is not noticed halfway through a generation, and a bad value is one clear error at start.

- ``MLXRUNNER_COMPILE`` (``1``/``0``, default 1): trace decode steps and verify blocks.
- ``MLXRUNNER_KERNELS`` (``1``, ``0`` or a comma-separated list of ``KERNELS``): which of
  the core's fused CUDA kernels may serve (each still only after its self-check;
  ``prenorms``: a pre-norm written by the product launch before it, with ``norms`` and
  ``products``; ``chains``: a product in the launch of the product whose rows it reads, with
  ``products``; ``embeddings``: an embedding's lookup; ``attention`` also makes a cache's
  first buffers, ``norms`` a prompt's heads and post-norm adds too).
- ``MLXRUNNER_ATTENTION`` (``kernel``, ``folded`` or ``mlx``): short-block attention on
  CUDA through the fused kernel, folded batched products, or MLX's own function.
- ``MLXRUNNER_ROW_PRODUCTS`` (``1``/``0``): on CUDA, short products (a few rows) as one-row
  products (see ``mlxrunner.nn.kernels.project``).
- ``MLXRUNNER_PACKED_KERNELS`` (``1``/``0``, default 1): on CUDA, the core's built kernels
  launch as compressed fat binaries where nvFatbin is installed (MLX hashes a kernel's image
  at every launch: see ``mlxrunner.nn.cuda_build``); 0: as the cubins themselves.
- ``MLXRUNNER_PROMPT_SUBMIT_LAYERS`` (a whole number; default: 2 on a GPU, 0 on the CPU): a
  prompt chunk's forward hands its residual stream to the device every this many layers
  (``mx.async_eval`` in :class:`mlxrunner.nn.Taps`), so that a GPU runs the first layers
  while Python builds the rest; 0: the whole chunk at once.
- ``MLXRUNNER_HOST_PRODUCTS`` (``1``/``0``): on MLX's CPU device off macOS, float32 products
  on the host (numpy's BLAS; quantized weights through the core's C loops, see
  ``mlxrunner.nn.host_quantized``), the decode steps that run enough of them eager, and the
  core's layers on the host in the forwards run to generate (``mlxrunner.nn.host_ops``).
- ``MLXRUNNER_LOAD_PLUGINS``: the plugins that load (comma-separated distribution or entry
  point names, as ``mlxrunner plugins`` lists them, compared as PEP 503 normalises them;
  empty: none; unset: all; a name no installed plugin has is one warning). The core's
  built-ins always load.
- ``MLXRUNNER_PREFIX_CACHE`` (``1``/``0``, default 1): ``serve`` and the chat keep model state
  across requests and turns (:class:`mlxrunner.cache.PrefixCache`), holding at most
  ``MLXRUNNER_PREFIX_CACHE_MIB`` MiB of arrays per model (default: scaled to the model and
  the machine, see ``mlxrunner.cache.prefix_cache_for``).
- ``MLXRUNNER_BATCH_MIB``: at most this many MiB of the batch's caches per model in ``serve``
  (default: scaled to the model and the machine, see ``mlxrunner.batch.batch_budget``); a
  request that would pass it waits for rows to end.
- ``MLXRUNNER_API_KEY``: the bearer token ``mlxrunner serve`` requires (unset: none).
- ``MLXRUNNER_ORIGINS``: browser origins ``mlxrunner serve`` accepts beyond this machine's
  (comma-separated glob patterns, as Ollama's ``OLLAMA_ORIGINS``; ``*``: any).
- ``MLX_PTX_CACHE_DIR`` (MLX's): the folder of MLX's built CUDA kernels; the core keeps its
  own kernels and their verdicts in ``mlxrunner/`` there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace

from .errors import MLXRunnerError

#: the fused kernels ``MLXRUNNER_KERNELS`` names
KERNELS = ("attention", "chains", "deltanet", "embeddings", "norms", "prenorms", "products",
           "topk")
ATTENTION_MODES = ("kernel", "folded", "mlx")
#: the most layers ``MLXRUNNER_PROMPT_SUBMIT_LAYERS`` takes
MAX_LAYERS = 1 << 16


class SettingsError(MLXRunnerError):
    """A switch with a value mlxrunner does not take."""


@dataclass(frozen=True)
class Settings:
    compile: bool = True
    kernels: frozenset[str] = frozenset(KERNELS)
    attention: str = "kernel"
    row_products: bool = True
    packed_kernels: bool = True
    host_products: bool = True
    #: None: the device's default (mlxrunner.nn.taps)
    prompt_submit_layers: int | None = None
    load_plugins: tuple[str, ...] | None = None
    prefix_cache: bool = True
    #: None: scaled to the model and the machine (mlxrunner.cache.prefix_cache_for)
    prefix_cache_mib: int | None = None
    #: None: scaled to the model and the machine (mlxrunner.batch.batch_budget)
    batch_mib: int | None = None
    api_key: str | None = field(default=None, repr=False)  # a secret: not in reprs
    origins: tuple[str, ...] = ()
    #: MLX's kernel cache folder (``MLX_PTX_CACHE_DIR``, MLX's own switch; None: MLX's
    #: default), where the core keeps its built kernels and their verdicts (mlxrunner.nn)
    kernel_cache: str | None = None
    #: MLX compiles functions (``MLX_DISABLE_COMPILE`` unset: MLX's own switch)
    mlx_compile: bool = True
    #: every decision is a function of the tokens alone (no wall-clock timing): set on the
    #: ranks of a distributed job, which must all make the same ones (mlxrunner.distributed)
    lockstep: bool = False

    def kernel_allowed(self, name: str) -> bool:
        return name in self.kernels

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        plugins = env.get("MLXRUNNER_LOAD_PLUGINS")
        return cls(
            compile=_flag(env, "MLXRUNNER_COMPILE", True),
            kernels=_kernels(env.get("MLXRUNNER_KERNELS", "1")),
            attention=_choice(env, "MLXRUNNER_ATTENTION", "kernel", ATTENTION_MODES),
            row_products=_flag(env, "MLXRUNNER_ROW_PRODUCTS", True),
            packed_kernels=_flag(env, "MLXRUNNER_PACKED_KERNELS", True),
            host_products=_flag(env, "MLXRUNNER_HOST_PRODUCTS", True),
            prompt_submit_layers=_layers(env, "MLXRUNNER_PROMPT_SUBMIT_LAYERS")
            if env.get("MLXRUNNER_PROMPT_SUBMIT_LAYERS", "").strip() else None,
            load_plugins=None if plugins is None else tuple(
                p.strip() for p in plugins.split(",") if p.strip()),
            prefix_cache=_flag(env, "MLXRUNNER_PREFIX_CACHE", True),
            prefix_cache_mib=_mib(env, "MLXRUNNER_PREFIX_CACHE_MIB")
            if env.get("MLXRUNNER_PREFIX_CACHE_MIB", "").strip() else None,
            batch_mib=_mib(env, "MLXRUNNER_BATCH_MIB")
            if env.get("MLXRUNNER_BATCH_MIB", "").strip() else None,
            api_key=env.get("MLXRUNNER_API_KEY") or None,
            origins=tuple(o.strip() for o in env.get("MLXRUNNER_ORIGINS", "").split(",")
                          if o.strip()),
            kernel_cache=env.get("MLX_PTX_CACHE_DIR") or None,
            mlx_compile=not env.get("MLX_DISABLE_COMPILE"),
        )


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env.get(name, "1" if default else "0").strip()
    if value not in ("0", "1"):
        raise SettingsError(f"{name}={value!r}: use 0 or 1")
    return value == "1"


def _layers(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "").strip()
    if not (value.isascii() and value.isdigit()) or int(value) > MAX_LAYERS:
        raise SettingsError(f"{name}={value!r}: use a whole number from 0 to {MAX_LAYERS}")
    return int(value)


def _mib(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "").strip()
    if not (value.isascii() and value.isdigit()):
        raise SettingsError(f"{name}={value!r}: use a whole number of MiB")
    return int(value)


def _choice(env: Mapping[str, str], name: str, default: str, options: tuple[str, ...]) -> str:
    value = env.get(name, default).strip() or default
    if value not in options:
        raise SettingsError(f"{name}={value!r}: use one of {', '.join(options)}")
    return value


def _kernels(value: str) -> frozenset[str]:
    value = value.strip()
    if value in ("", "1"):
        return frozenset(KERNELS)
    if value == "0":
        return frozenset()
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise SettingsError(f"MLXRUNNER_KERNELS={value!r}: unknown kernel {unknown[0]!r} (use "
                            f"0, 1 or a comma-separated list of {', '.join(KERNELS)})")
    return frozenset(names)


_current: Settings | None = None


def current() -> Settings:
    """The settings in force (the environment's, read at the first call)."""
    global _current
    if _current is None:
        _current = Settings.from_environment()
    return _current


def configure(**changes: object) -> Settings:
    """Change settings before work starts (the command line's switches)."""
    global _current
    names = {f.name for f in fields(Settings)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise TypeError(f"unknown setting {unknown[0]!r}")
    _current = replace(current(), **changes)  # type: ignore[arg-type]
    return _current


@contextmanager
def overridden(**changes: object) -> Iterator[Settings]:
    """Settings changed for a block (tests and benchmarks' A/B rows), then put back."""
    global _current
    saved = current()
    try:
        yield configure(**changes)
    finally:
        _current = saved
