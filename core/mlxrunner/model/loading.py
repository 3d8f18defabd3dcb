"""Loading a Hugging Face model folder's target into a registered architecture.

``load_model(path)`` gives the target with its weights (the whole bundle, with tokenizer,
renderer, parser and draft, is :func:`mlxrunner.bundle.load`). Every problem with the
folder becomes one ModelFolderError line.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import ModelFolderError, UnknownNameError
from ..files import NotRegularFile, read_regular
from ..host import manager as plugins
from ..nn.kernels import host_products
from .config_bounds import check_config
from .interface import Model
from .safetensors import check_safetensors

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16,
          "fp32": mx.float32, "fp16": mx.float16, "bf16": mx.bfloat16}


MAX_JSON_BYTES = 64 * 1024 * 1024
#: a Hugging Face Hub repository id, which ``mlxrunner pull`` fetches
HUB_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def check_regular(path: Path, what: str) -> None:
    """Refuse a model folder's file that is not a regular file (through a link or not): a
    FIFO would block its reader for good, a device (a link to /dev/zero) never ends."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ModelFolderError(f"{path.parent}: no {what} ({path.name})") from None
    except OSError as exc:
        raise ModelFolderError(f"{path}: {what} cannot be read ({exc.strerror or exc})") \
            from None
    if not stat.S_ISREG(mode):
        raise ModelFolderError(f"{path}: {what} is not a regular file")


def read_bounded(path: Path, what: str, limit: int) -> bytes:
    """A regular file's bytes, at most ``limit`` of them (more is one ModelFolderError)."""
    check_regular(path, what)
    try:
        data = read_regular(path, limit)
    except NotRegularFile:
        raise ModelFolderError(f"{path}: {what} is not a regular file") from None
    except OSError as exc:
        raise ModelFolderError(f"{path}: {what} cannot be read ({exc.strerror or exc})") \
            from None
    if len(data) > limit:
        raise ModelFolderError(f"{path}: {what} is larger than {limit} bytes")
    return data


def read_json(path: Path, what: str, limit: int = MAX_JSON_BYTES) -> Any:
    """A JSON file's value; missing, not a regular file, over ``limit`` bytes or malformed is
    one ModelFolderError naming ``what``."""
    try:
        return json.loads(read_bounded(path, what, limit).decode("utf-8"))
    except FileNotFoundError:
        raise ModelFolderError(f"{path.parent}: no {what} ({path.name})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFolderError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ModelFolderError(f"{path}: not valid JSON (nested too deeply)") from None


#: the most bytes of an image processor's settings file read
MAX_PROCESSOR_CONFIG_BYTES = 1024 * 1024


def read_processor_config(folder: str | Path) -> dict[str, Any] | None:
    """A folder's image processor settings as transformers finds them: the
    ``image_processor`` object of ``processor_config.json`` if it has one, else
    ``preprocessor_config.json``; None when neither is there. Each file is read only if
    regular and at most :data:`MAX_PROCESSOR_CONFIG_BYTES`; a bad one is one
    ModelFolderError line."""
    folder = Path(folder)
    nested = _json_object(folder / "processor_config.json")
    if nested is not None:
        inner = nested.get("image_processor")
        if inner is not None:
            if not isinstance(inner, dict):
                raise ModelFolderError(f"{folder / 'processor_config.json'}: image_processor "
                                       "must be an object")
            return inner
    return _json_object(folder / "preprocessor_config.json")


def _json_object(path: Path) -> dict[str, Any] | None:
    if not os.path.lexists(path):
        return None
    value = read_json(path, path.name, MAX_PROCESSOR_CONFIG_BYTES)
    if not isinstance(value, dict):
        raise ModelFolderError(f"{path}: expected a JSON object")
    return value


def resolve_model_path(path: str | Path) -> Path:
    """A folder, or a model name: the store's entry, a source a plugin registered (pulled
    into the store on first use), or a folder a plugin registered (``default``)."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ModelFolderError(f"{p}: not a model folder")
        return p
    stored = plugins.find_model(str(path))
    if stored is not None:
        return stored
    models = plugins.host().registry("models")
    registered = models.get(str(path))
    if registered is not None:
        target = str(registered.obj)
        if target in models and target != str(path) and not Path(target).exists():
            return resolve_model_path(target)  # another name for a registered model
        return Path(registered.obj)
    if HUB_REPO.fullmatch(str(path)):
        raise ModelFolderError(f"{p}: model folder not found (`mlxrunner pull {path}` "
                               "fetches it from the Hugging Face Hub)")
    if "/" in str(path) or "\\" in str(path) or str(path).startswith("."):
        raise ModelFolderError(f"{p}: model folder not found")
    raise ModelFolderError(unknown_model(str(path)))


def unknown_model(name: str) -> str:
    """One line for a name that is no folder, no stored and no registered model: the
    closest known names, what is known, and how to fetch one."""
    stored = plugins.stored_names()
    known = sorted(set(stored) | set(plugins.names("models")))
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    shown = f"{name[:80]!r}" + ("..." if len(name) > 80 else "")
    return (f"unknown model {shown}" + (f" (did you mean {' or '.join(close)}?)" if close else "")
            + f"; stored: {', '.join(stored) or 'none'}; registered: "
            + f"{', '.join(plugins.names('models')) or 'none'}; `mlxrunner pull OWNER/NAME` "
            "fetches a Hugging Face repository")


def read_config(path: str | Path) -> dict[str, Any]:
    """The folder's config.json as a dict (checked to name an architecture)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelFolderError(f"{folder}: model folder not found")
    config = read_json(folder / "config.json", "config.json")
    if not isinstance(config, dict):
        raise ModelFolderError(f"{folder / 'config.json'}: expected a JSON object")
    if not config.get("architectures") and not config.get("model_type"):
        raise ModelFolderError(f"{folder / 'config.json'}: names no architecture "
                               "(neither 'architectures' nor 'model_type')")
    archs, model_type = config.get("architectures"), config.get("model_type")
    if archs is not None and not (isinstance(archs, list)
                                  and all(isinstance(a, str) for a in archs)):
        raise ModelFolderError(f"{folder / 'config.json'}: architectures must be a list of "
                               "names")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelFolderError(f"{folder / 'config.json'}: model_type must be a name")
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text part a target is built from: ``text_config`` with top-level keys filled in."""
    inner = config.get("text_config")
    if not isinstance(inner, dict):
        return dict(config)
    merged = dict(inner)
    for key, value in config.items():
        if key != "text_config" and key not in merged:
            merged[key] = value
    merged.setdefault("architectures", config.get("architectures"))
    return merged


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_inside(folder: Path, path: Path, what: str) -> None:
    """Refuse a file of ``folder`` that resolves outside it (through a link). The Hugging
    Face cache's own layout, ``snapshots/<revision>/`` files linking into the repository's
    ``blobs/``, is inside."""
    root, target = folder.resolve(), path.resolve()
    if _within(target, root):
        return
    if root.parent.name == "snapshots" and _within(target, root.parent.parent / "blobs"):
        return
    raise ModelFolderError(f"{folder}: {what} leads outside the model folder")


def _shard_path(folder: Path, index: Path, name: Any) -> Path:
    if not isinstance(name, str) or not name:
        raise ModelFolderError(f"{index}: weight_map entry {name!r:.80} is not a file name")
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if (posix.is_absolute() or windows.is_absolute() or windows.drive
            or ".." in posix.parts or ".." in windows.parts):
        raise ModelFolderError(f"{index}: weight_map entry {name!r:.80} points outside the "
                               "model folder")
    path = folder / name
    if not path.is_file():
        raise ModelFolderError(f"{folder}: shard {name!r:.80} named in {index.name} is missing")
    check_inside(folder, path, f"weight_map entry {name!r:.80}")
    return path


def weight_files(folder: Path, prefix: str = "model") -> list[Path]:
    """The safetensors files of a folder: the index's shards, or the single file; every one
    inside the folder."""
    index = folder / f"{prefix}.safetensors.index.json"
    if index.exists():
        data = read_json(index, "weight index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFolderError(f"{index}: empty or missing weight_map")
        names = set(weight_map.values())
        if not all(isinstance(name, str) for name in names):
            bad = next(name for name in names if not isinstance(name, str))
            raise ModelFolderError(f"{index}: weight_map entry {bad!r:.80} is not a file name")
        return [_shard_path(folder, index, name) for name in sorted(names)]
    single = folder / f"{prefix}.safetensors"
    if single.exists():
        files = [single]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = " (pickle weights are never loaded: convert to safetensors)" if pickles else ""
        raise ModelFolderError(f"{folder}: no safetensors weights{hint}")
    for f in files:
        check_inside(folder, f, f"weight file {f.name!r}")
        check_regular(f, f"weight file {f.name!r}")
    return files


def read_weights(files: list[Path]) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in files:
        check_safetensors(f)
        try:
            # a safetensors file loads as a dict of arrays
            weights.update(cast("dict[str, mx.array]", mx.load(str(f))))
        except Exception as exc:  # MLX reports corrupt files with assorted errors
            raise ModelFolderError(f"{f}: cannot load safetensors ({exc})") from None
    return weights


# The (bits, group size) each non-affine mode allows, as MLX packs them.
_FIXED_MODES = {(4, 32): "mxfp4", (8, 32): "mxfp8", (4, 16): "nvfp4"}


def _packed_params(path: str, module: nn.Module, weights: dict[str, mx.array],
                   top_mode: str) -> dict[str, Any] | None:
    """A module's group size, bits and mode read off its packed tensors (None when its
    shapes do not say): only affine stores biases and keeps its scales in a float dtype."""
    packed, scales = weights.get(f"{path}.weight"), weights[f"{path}.scales"]
    dense = getattr(module, "weight", None)
    if packed is None or dense is None:
        return None
    in_dim = dense.shape[-1]
    if in_dim % scales.shape[-1] or (packed.shape[-1] * 32) % in_dim:
        return None
    group_size, bits = in_dim // scales.shape[-1], packed.shape[-1] * 32 // in_dim
    if f"{path}.biases" in weights or scales.dtype != mx.uint8:
        mode = "affine"
    else:
        mode = _FIXED_MODES.get((bits, group_size), top_mode)
    return {"group_size": group_size, "bits": bits, "mode": mode}


def quantize_for_checkpoint(model: nn.Module, config: dict[str, Any],
                            weights: dict[str, mx.array]) -> None:
    """Turn the modules a quantized checkpoint quantized into quantized modules."""
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict) or "bits" not in q:
        return
    group_size, bits = int(q.get("group_size", 64)), int(q["bits"])
    mode = q.get("mode", "affine")
    predicate_of_model = getattr(model, "quantize_predicate", None)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if f"{path}.scales" not in weights:
            return False
        if predicate_of_model is not None and not predicate_of_model(path, module):
            return False
        # Mixed-precision checkpoints key their per-module overrides by their own module
        # names, which sanitize renames (mlx-lm's routers: 8-bit affine under an mxfp4
        # top mode), so the packed tensors are read first.
        packed = _packed_params(path, module, weights, mode)
        if packed is not None:
            return packed
        override = q.get(path)
        if isinstance(override, dict):  # MLX's to_quantized: no mode given is affine
            return {"group_size": int(override.get("group_size", group_size)),
                    "bits": int(override.get("bits", bits)),
                    "mode": override.get("mode", "affine")}
        return True

    nn.quantize(model, group_size, bits, mode=mode, class_predicate=predicate)


def assign_weights(model: nn.Module, weights: dict[str, mx.array], where: Path) -> None:
    """Strict load: every parameter gets a tensor of its shape, nothing is left over."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFolderError(f"{where}: missing tensor {missing[0]!r}{more}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ModelFolderError(f"{where}: unexpected tensor {unexpected[0]!r}{more}")
    for name, value in weights.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise ModelFolderError(
                f"{where}: tensor {name!r} has shape {tuple(value.shape)}, "
                f"the model expects {tuple(expected[name].shape)}")
    model.load_weights(list(weights.items()), strict=False)


def cast_floats(weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    return {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype
            else v for k, v in weights.items()}


def declared_dtype(config: dict[str, Any]) -> mx.Dtype | None:
    """The dtype config.json declares (``dtype``, formerly ``torch_dtype``; the text part's
    first), as transformers' ``dtype="auto"`` reads it; None when absent or not MLX's."""
    for source in (config.get("text_config"), config):
        if not isinstance(source, dict):
            continue
        for key in ("dtype", "torch_dtype"):
            value = source.get(key)
            if isinstance(value, str) and value in DTYPES:
                return DTYPES[value]
    return None


def parse_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype | None:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise UnknownNameError(f"unknown dtype {dtype!r} (choose from "
                               f"{', '.join(sorted(DTYPES))})") from None


def install_weights(module: nn.Module, config: dict[str, Any], weights: dict[str, mx.array],
                    where: Path, dtype: str | mx.Dtype | None = None,
                    what: str = "architecture") -> None:
    """Sanitize, quantize as the checkpoint was, cast on request, load strictly, evaluate."""
    try:
        weights = module.sanitize(weights)
    except (KeyError, ValueError, IndexError) as exc:
        raise ModelFolderError(
            f"{where}: checkpoint does not fit the {what} ({exc})") from None
    quantize_for_checkpoint(module, config, weights)
    target_dtype = parse_dtype(dtype)
    if target_dtype is not None:
        weights = cast_floats(weights, target_dtype)
    assign_weights(module, weights, where)
    mx.eval(module.parameters())
    module.eval()


def load_part(folder: str | Path, config_key: str, prefixes: tuple[str, ...],
              build: Callable[[dict[str, Any], dict[str, Any]], nn.Module],
              dtype: str | mx.Dtype | None = None, what: str = "part") -> Any:
    """A part of a checkpoint the core does not load with the model (a vision or an audio
    tower): ``build(config[config_key], config)`` given the folder's tensors whose names
    start with one of ``prefixes`` (the module's ``sanitize`` maps them), float weights in
    ``dtype``. None where config.json has no ``config_key`` or no tensor has such a name.
    The folder is read as the model's (safetensors only, every file inside it); a part
    that is not an object, quantized or does not fit is one ModelFolderError line."""
    folder = Path(folder)
    config = read_config(folder)
    part = config.get(config_key)
    if part is None:
        return None
    if not isinstance(part, dict):
        raise ModelFolderError(f"{folder}/config.json: {config_key} must be an object")
    weights = {name: array for name, array in read_weights(weight_files(folder)).items()
               if name.startswith(prefixes)}
    if not weights:
        return None
    if any(name.endswith((".scales", ".biases")) for name in weights):
        raise ModelFolderError(f"{folder}: a quantized {what} is not supported")
    module = build(part, config)
    install_weights(module, config, weights, folder, dtype, what=what)
    return module


def build_model(config: dict[str, Any], where: str = "config.json") -> Model:
    """A fresh (randomly initialised) model of the architecture a parsed config.json names;
    its values are checked against their bounds first (nothing is built when one is out)."""
    cls = plugins.architecture_for(config)
    text = text_config(config)
    check_config(text, cls, where)
    return cls(text)


def load_model(path: str | Path, dtype: str | mx.Dtype | None = None) -> Model:
    """The target of a model folder with its weights loaded, in ``dtype`` if given, else in
    the dtype its config.json declares (a folder may store bf16 weights and declare float32
    to compute in), else in the weights' own; half precision is computed in float32 on MLX's
    CPU device off macOS where that fits (see :func:`host_dtype`)."""
    folder = resolve_model_path(path)
    config = read_config(folder)
    model = build_model(config, str(folder / "config.json"))
    weights = read_weights(weight_files(folder))
    # A bundle may carry its draft beside the target; those tensors are not the target's.
    weights = {k: v for k, v in weights.items() if not k.startswith("draft.")}
    install_weights(model, config, weights, folder,
                    dtype if dtype is not None else host_dtype(declared_dtype(config), weights))
    return model


#: the share of this machine's memory float32 copies of half-precision weights may take for
#: the CPU to compute in float32 (the caches and the prefix cache need the rest)
HOST_FLOAT32_SHARE = 1 / 3


def host_dtype(declared: mx.Dtype | None, weights: dict[str, mx.array],
               memory: int | None = None) -> mx.Dtype | None:
    """The dtype to compute in where none was asked for: float32 for half-precision weights
    (``declared``, else the weights' own) on MLX's CPU device off macOS, where their float32
    copies take at most ``HOST_FLOAT32_SHARE`` of ``memory`` (default: this machine's);
    else ``declared``. MLX's Linux CPU build multiplies half precision through slow loops
    while float32 products run on the host BLAS (:func:`mlxrunner.nn.kernels.host_products`):
    the 0.8B Qwen3.5 shape decoded 1.5 tok/s in bfloat16 on a 2-core CPU, 5.1 in float32
    (``bench/qwen3_5.py --dtype``)."""
    if not host_products():
        return declared
    floats = [v for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)]
    half = (mx.bfloat16, mx.float16)
    if not ((declared is not None and declared in half) or
            (declared is None and floats and all(v.dtype in half for v in floats))):
        return declared
    if memory is None:
        try:
            memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return declared
    needed = 4 * sum(v.size for v in floats)
    return mx.float32 if needed <= memory * HOST_FLOAT32_SHARE else declared
