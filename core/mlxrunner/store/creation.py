"""``create NAME -f Modelfile``: a self-contained entry from a Modelfile's FROM target (and
its draft), optionally quantized with MLX.

Quantized weights keep the checkpoint's own tensor names and layout: a module's weight is
quantized where the architecture's ``sanitize`` passes it through unchanged (renamed at
most), and its ``scales``/``biases`` are written beside it under the same prefix, so that
loading sanitizes them the same way. ``config.json`` records the quantization as mlx-lm
does (``quantization`` and ``quantization_config``: ``group_size``, ``bits``, ``mode``),
which :func:`mlxrunner.model.loading.quantize_for_checkpoint` reads back.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..bundle import Bundle, load
from ..model.draft import BUNDLE_PREFIX
from ..model.loading import declared_dtype, read_weights, weight_files
from ..model.modelfile import Modelfile, parse_modelfile
from .describe import quantization_label
from .sources import QUANTIZATIONS
from .store import Entry, Store, StoreError

log = logging.getLogger("mlxrunner.store")

#: files of a model folder that are not carried over as they are (rewritten, or weights)
_REWRITTEN = {"config.json", "Modelfile", "manifest.json"}
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".pkl", ".pickle", ".gguf",
                        ".ckpt", ".h5", ".msgpack", ".onnx")
#: the largest weight file written (larger checkpoints are sharded with an index)
SHARD_BYTES = 4 << 30


def check_quantization(label: str | None) -> tuple[str, int, int] | None:
    if label is None:
        return None
    if label not in QUANTIZATIONS:
        raise StoreError(f"unknown quantization {label!r} (choose from "
                         f"{', '.join(QUANTIZATIONS)})")
    mode, bits, group = QUANTIZATIONS[label]
    try:  # this MLX build may lack a mode
        probe = mx.quantize(mx.zeros((8, 4 * group)), group_size=group, bits=bits, mode=mode)
        mx.eval(*probe)
    except (ValueError, RuntimeError) as exc:
        raise StoreError(f"--quantize {label}: this MLX build cannot quantize "
                         f"in {mode} mode ({exc})") from None
    return QUANTIZATIONS[label]


def quantize_weights(module: nn.Module, raw: dict[str, mx.array], spec: tuple[str, int, int],
                     dtype: mx.Dtype | None) -> tuple[dict[str, mx.array], int]:
    """``raw`` (checkpoint names) with the weights of ``module``'s quantizable modules
    quantized; returns the new tensors and how many modules were quantized. Each weight is
    quantized in ``dtype``, the dtype the model computes in (default: the weight's own), so
    that the result is what quantizing the loaded model gives."""
    mode, bits, group = spec
    sanitized = module.sanitize(dict(raw))
    origin = {id(value): key for key, value in raw.items()}
    predicate = getattr(module, "quantize_predicate", None)
    out = dict(raw)
    count = 0
    for path, sub in module.named_modules():
        if not path or not hasattr(sub, "to_quantized"):
            continue
        if predicate is not None and not predicate(path, sub):
            continue
        weight = sanitized.get(f"{path}.weight")
        if weight is None or weight.ndim != 2 or weight.shape[-1] % group:
            continue
        raw_name = origin.get(id(weight))
        if raw_name is None or not raw_name.endswith(".weight"):
            continue  # sanitize computes this weight: its checkpoint tensor is not it
        prefix = raw_name[:-len(".weight")]
        values = weight.astype(dtype) if dtype is not None else weight
        packed, *rest = mx.quantize(values, group_size=group, bits=bits, mode=mode)
        out[raw_name] = packed
        out[f"{prefix}.scales"] = rest[0]
        if mode == "affine":
            out[f"{prefix}.biases"] = rest[1]
        count += 1
    return out, count


def _quantization_record(spec: tuple[str, int, int]) -> dict[str, Any]:
    mode, bits, group = spec
    return {"group_size": group, "bits": bits, "mode": mode}


def _save_weights(weights: dict[str, mx.array], folder: Path) -> None:
    """``model.safetensors``, or shards of at most SHARD_BYTES with an index."""
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for name in sorted(weights):
        value = weights[name]
        if size and size + value.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    metadata = {"format": "mlx"}
    if len(shards) == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), shards[0], metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(folder / file), shard, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _copy_weight_files(source: Path, folder: Path) -> None:
    files = weight_files(source)
    for f in files:
        shutil.copy2(f, folder / f.name)
    index = source / "model.safetensors.index.json"
    if index.is_file():
        shutil.copy2(index, folder / index.name)


def _link_or_copy(source: Path, target: Path, root: Path) -> None:
    """A hard link to a file of another entry (entries are replaced whole, never edited, so
    sharing a large file is safe), else a copy (a file outside the store may be edited)."""
    if root.resolve() in source.resolve().parents:
        try:
            os.link(source, target)
            return
        except OSError:
            pass
    shutil.copy2(source, target)


def _copy_side_files(source: Path, folder: Path) -> None:
    """Tokenizer, template, generation config, licence and card: every top-level file that
    is not weights and not rewritten."""
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name not in _REWRITTEN and not f.name.startswith(".") and \
                not f.name.lower().endswith(_NOT_COPIED_SUFFIXES) and \
                f.name != "model.safetensors.index.json":
            shutil.copy2(f, folder / f.name)


def _read_config(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise StoreError(f"{path}: expected a JSON object")
    return data


def _write_config(config: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _write_part(module: nn.Module, source: Path, folder: Path, spec: tuple[str, int, int] | None,
                what: str, keep: Any = lambda name: True) -> None:
    """One part (target or draft folder): config.json and weights, quantized when asked."""
    config = _read_config(source / "config.json")
    already = quantization_label(config.get("quantization") or config.get("quantization_config"))
    if spec is None:
        _copy_weight_files(source, folder)
        _write_config(config, folder / "config.json")
        return
    if already is not None:
        raise StoreError(f"{source}: the {what} is already quantized ({already}); create from "
                         "the unquantized model")
    raw = read_weights(weight_files(source))
    own = {k: v for k, v in raw.items() if keep(k)}
    others = {k: v for k, v in raw.items() if not keep(k)}
    quantized, count = quantize_weights(module, own, spec, declared_dtype(config))
    if count == 0:
        raise StoreError(f"{source}: no module of the {what} can be quantized with group size "
                         f"{spec[2]}")
    log.info("quantized %d modules of the %s (%s)", count, what, quantization_label(
        _quantization_record(spec)))
    _save_weights({**quantized, **others}, folder)
    config["quantization"] = _quantization_record(spec)
    config["quantization_config"] = _quantization_record(spec)
    _write_config(config, folder / "config.json")


def write_gguf_folder(gguf_path: Path, folder: Path,
                      spec: tuple[str, int, int] | None = None) -> None:
    """A Hugging Face folder from a GGUF file, in ``folder`` (which exists and is empty):
    ``config.json``, the weights as safetensors, ``tokenizer.json`` and
    ``tokenizer_config.json`` (its tokens and chat template). Without ``spec`` the weights
    are what loading the file gives (its 4- and 8-bit blocks as MLX's affine quantization,
    the same numbers); with one, they are dequantized to float32 and quantized again."""
    from ..model.gguf import gguf_source, gguf_tokenizer
    from ..model.loading import build_model

    gguf, config, weights = gguf_source(gguf_path)
    config = dict(config)
    if spec is not None:
        held = config.pop("quantization", None) or {}
        weights = _dequantized(weights, int(held.get("group_size", 32)))
        module = build_model(config, str(gguf_path))
        weights, count = quantize_weights(module, weights, spec, declared_dtype(config))
        if count == 0:
            raise StoreError(f"{gguf_path}: no module can be quantized with group size "
                             f"{spec[2]}")
        config["quantization"] = _quantization_record(spec)
        config["quantization_config"] = _quantization_record(spec)
    elif "quantization" in config:
        config["quantization_config"] = config["quantization"]
    _save_weights(weights, folder)
    _write_config(config, folder / "config.json")
    tokenizer = gguf_tokenizer(gguf)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    settings: dict[str, Any] = {"add_bos_token": tokenizer.add_bos_token}
    for role in ("bos", "eos", "pad", "unk"):
        token = getattr(tokenizer, f"{role}_token")
        if token is not None:
            settings[f"{role}_token"] = token
    if tokenizer.chat_template is not None:
        settings["chat_template"] = tokenizer.chat_template
    extra_eos = sorted(set(tokenizer.eos_ids) - {tokenizer.eos_id})
    if extra_eos:  # an end-of-turn token beside the end of text
        (folder / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": [i for i in [tokenizer.eos_id, *extra_eos] if i is not None]},
            indent=2) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n",
                                                  encoding="utf-8")


def convert_gguf(gguf_path: Path, destination: Path, quantize: str | None = None) -> None:
    """``mlxrunner convert``: the Hugging Face folder of a GGUF file at ``destination`` (a
    new folder), written under a temporary name and renamed when whole."""
    spec = check_quantization(quantize)
    if destination.exists():
        raise StoreError(f"{destination}: already exists (name a new folder)")
    parent = destination.parent
    if not parent.is_dir():
        raise StoreError(f"{parent}: no such folder")
    building = parent / f".{destination.name}.converting-{os.getpid()}"
    building.mkdir()
    try:
        write_gguf_folder(gguf_path, building, spec)
        os.replace(building, destination)
    finally:
        if building.exists():
            shutil.rmtree(building, ignore_errors=True)


def _dequantized(weights: dict[str, mx.array], group: int) -> dict[str, mx.array]:
    """Packed weights (uint32, with their ``scales`` and ``biases``: MLX's affine mode in
    groups of ``group``, each module's bits read off its shapes) as float32."""
    packed = {name[:-len(".weight")] for name, value in weights.items()
              if name.endswith(".weight") and value.dtype == mx.uint32}
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        prefix, _, part = name.rpartition(".")
        if prefix not in packed or part not in ("weight", "scales", "biases"):
            out[name] = value  # (a module's own bias stays)
        elif part == "weight":
            scales = weights[f"{prefix}.scales"]
            bits = value.shape[-1] * 32 // (scales.shape[-1] * group)
            out[name] = mx.dequantize(value, scales, weights.get(f"{prefix}.biases"),
                                      group_size=group, bits=bits, dtype=mx.float32)
    return out


def _quoted(value: str) -> str:
    if "\n" in value or value != value.strip() or not value:
        return f'"""{value}"""'
    return f'"{value}"'


def _parameter_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def modelfile_text(modelfile: Modelfile | None, weights: str = ".") -> str:
    """The entry's own Modelfile: FROM itself (or its GGUF file), with the renderer, parser,
    parameters and system prompt of the Modelfile it was created from (its draft is
    ``draft/``)."""
    lines = [f"FROM {weights}"]
    if modelfile is not None:
        if modelfile.renderer:
            lines.append(f"RENDERER {modelfile.renderer}")
        if modelfile.parser:
            lines.append(f"PARSER {modelfile.parser}")
        for name, value in modelfile.parameters.items():
            for item in value if isinstance(value, list) else [value]:
                text = _quoted(item) if name == "stop" else _parameter_text(item)
                lines.append(f"PARAMETER {name} {text}")
        if modelfile.system is not None:
            lines.append(f"SYSTEM {_quoted(modelfile.system)}")
    text = "\n".join(lines) + "\n"
    # what is written must read back as meant (a value whose quotes would end early)
    back = parse_modelfile(text, base_dir=".")
    if modelfile is not None and (back.renderer, back.parser, back.parameters, back.system) != \
            (modelfile.renderer, modelfile.parser, modelfile.parameters, modelfile.system):
        raise StoreError("the Modelfile's values cannot be written back unchanged (a quoted "
                         "value holding its own closing quotes)")
    return text


def create(store: Store, name: str, modelfile: str | Path, quantize: str | None = None,
           draft_quantize: str | None = None) -> Entry:
    """Entry ``name`` built from ``modelfile`` (a Modelfile, or a model folder)."""
    target_spec = check_quantization(quantize)
    draft_spec = check_quantization(draft_quantize)
    path = Path(modelfile).expanduser()
    if not path.exists():
        raise StoreError(f"{path}: no such Modelfile")
    bundle: Bundle = load(path)
    if draft_spec is not None and bundle.draft is None:
        raise StoreError(f"{path}: --draft-quantize given, but the model has no draft")
    if bundle.draft is not None and bundle.draft_path is None and draft_spec is not None:
        raise StoreError(f"{bundle.path}: the draft is inside the target's weights (draft.* "
                         "tensors); only a draft folder can be quantized on its own")
    source = {"type": "create", "modelfile": str(path.absolute()),
              "from": str(bundle.path.absolute()), "quantize": quantize,
              "draft_quantize": draft_quantize}
    gguf = bundle.extra.get("gguf")
    with store.writing(name, source) as building:
        weights = "."
        if gguf is not None and target_spec is not None:  # dequantized, quantized again
            write_gguf_folder(gguf.path, building, target_spec)
        elif gguf is not None:  # the file is the weights, tokenizer and template
            _link_or_copy(gguf.path, building / gguf.path.name, store.root)
            weights = f"./{gguf.path.name}"
        else:
            _write_part(bundle.model, bundle.path, building, target_spec, "target",
                        keep=lambda n: not n.startswith(BUNDLE_PREFIX))
            _copy_side_files(bundle.path, building)
        if bundle.draft is not None and bundle.draft_path is not None:
            draft_folder = building / "draft"
            draft_folder.mkdir()
            _write_part(bundle.draft, bundle.draft_path, draft_folder, draft_spec, "draft")
            _copy_side_files(bundle.draft_path, draft_folder)
        (building / "Modelfile").write_text(modelfile_text(bundle.modelfile, weights),
                                            encoding="utf-8")
    entry = store.get(name)
    assert entry is not None
    return entry
