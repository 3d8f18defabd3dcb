"""Loading a Hugging Face model folder into a registered architecture.

``load_model(path)`` gives the target with its weights; ``load(path, ...)``
the whole bundle: model, tokenizer, renderer, parser, draft and generation
defaults. Every problem with the folder becomes one ModelFolderError line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import plugins
from .errors import ModelFolderError, UnknownNameError
from .model import Model
from .safetensors_check import check_safetensors

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16,
          "fp32": mx.float32, "fp16": mx.float16, "bf16": mx.bfloat16}


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFolderError(f"{path.parent}: no {what} ({path.name})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFolderError(f"{path}: not valid JSON ({exc})") from None


def resolve_model_path(path: str | Path) -> Path:
    """A folder, or the name of a model a plugin registered (``default``)."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ModelFolderError(f"{p}: not a model folder")
        return p
    registered = plugins.host().registry("models").get(str(path))
    if registered is not None:
        return Path(registered.obj)
    if "/" in str(path) or "\\" in str(path) or str(path).startswith("."):
        raise ModelFolderError(f"{p}: model folder not found")
    names = ", ".join(plugins.names("models")) or "none"
    raise ModelFolderError(f"{path}: no such model folder or registered model "
                           f"(registered: {names})")


def read_config(path: str | Path) -> dict[str, Any]:
    """The folder's config.json as a dict (checked to name an architecture)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelFolderError(f"{folder}: model folder not found")
    config = _read_json(folder / "config.json", "config.json")
    if not isinstance(config, dict):
        raise ModelFolderError(f"{folder / 'config.json'}: expected a JSON object")
    if not config.get("architectures") and not config.get("model_type"):
        raise ModelFolderError(f"{folder / 'config.json'}: names no architecture "
                               "(neither 'architectures' nor 'model_type')")
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


def weight_files(folder: Path, prefix: str = "model") -> list[Path]:
    """The safetensors files of a folder: the index's shards, or the single file."""
    index = folder / f"{prefix}.safetensors.index.json"
    if index.exists():
        data = _read_json(index, "weight index")
        shards = sorted(set((data.get("weight_map") or {}).values()))
        if not shards:
            raise ModelFolderError(f"{index}: empty weight_map")
        files = [folder / s for s in shards]
        for f in files:
            if not f.exists():
                raise ModelFolderError(f"{folder}: shard {f.name} named in {index.name} is missing")
        return files
    single = folder / f"{prefix}.safetensors"
    if single.exists():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = " (pickle weights are never loaded: convert to safetensors)" if pickles else ""
        raise ModelFolderError(f"{folder}: no safetensors weights{hint}")
    return files


def read_weights(files: list[Path]) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in files:
        check_safetensors(f)
        try:
            weights.update(mx.load(str(f)))
        except Exception as exc:  # MLX reports corrupt files with assorted errors
            raise ModelFolderError(f"{f}: cannot load safetensors ({exc})") from None
    return weights


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
        # Read each module's bits and group size off its packed tensors: mixed-precision
        # checkpoints key their overrides by their own module names, which sanitize renames.
        packed, scales = weights.get(f"{path}.weight"), weights[f"{path}.scales"]
        dense = getattr(module, "weight", None)
        if packed is not None and dense is not None and mode == "affine":
            in_dim = dense.shape[-1]
            if in_dim % scales.shape[-1] == 0 and (packed.shape[-1] * 32) % in_dim == 0:
                return {"group_size": in_dim // scales.shape[-1],
                        "bits": packed.shape[-1] * 32 // in_dim, "mode": mode}
        override = q.get(path)
        if isinstance(override, dict):
            return {"group_size": int(override.get("group_size", group_size)),
                    "bits": int(override.get("bits", bits)),
                    "mode": override.get("mode", mode)}
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


def build_model(config: dict[str, Any]) -> Model:
    """A fresh (randomly initialised) model of the architecture a parsed config.json names."""
    cls = plugins.architecture_for(config)
    return cls(text_config(config))


def load_model(path: str | Path, dtype: str | mx.Dtype | None = None) -> Model:
    """The target of a model folder with its weights loaded, in ``dtype`` if given, else in
    the dtype its config.json declares (a folder may store bf16 weights and declare float32
    to compute in), else in the weights' own."""
    folder = resolve_model_path(path)
    config = read_config(folder)
    model = build_model(config)
    weights = read_weights(weight_files(folder))
    # A bundle may carry its draft beside the target; those tensors are not the target's.
    weights = {k: v for k, v in weights.items() if not k.startswith("draft.")}
    install_weights(model, config, weights, folder,
                    dtype if dtype is not None else declared_dtype(config))
    return model


@dataclass
class Bundle:
    """Everything ``mlxrunner run`` needs for one model folder."""

    path: Path
    config: dict[str, Any]
    model: Model
    tokenizer: Any
    renderer: Any | None = None
    renderer_name: str | None = None
    parser: Any | None = None
    parser_name: str | None = None
    draft: Any | None = None
    draft_path: Path | None = None
    defaults: Any = None
    modelfile: Any | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def new_parser(self) -> Any | None:
        """A parser of its own for one reply (a parser holds the state of the reply it is
        parsing, so concurrent replies must not share one)."""
        if self.parser_name is None:
            return None
        from .chat import get_parser

        return get_parser(self.parser_name, self.extra.get("context"))

    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end a reply: the tokenizer's EOS ids, the model's own, and the
        renderer's stop markers (e.g. an end-of-turn token)."""
        tok = self.tokenizer
        ids = set(tok.eos_ids) | set(getattr(self.model, "eos_token_ids", ()) or ())
        for marker in getattr(self.renderer, "stop_markers", ()) or ():
            marker_id = tok.token_to_id(marker)
            if marker_id is not None:
                ids.add(marker_id)
        return frozenset(ids)


def parameter_count(model: nn.Module) -> int:
    """Parameters as the unquantized model would have them (packed weights unpacked)."""
    total = 0
    for _, module in model.named_modules():
        bits = getattr(module, "bits", None)
        for name, value in module.parameters().items():
            if not isinstance(value, mx.array):
                continue
            if name in ("scales", "biases") and bits:
                continue
            if name == "weight" and bits:
                total += value.size * 32 // bits
            else:
                total += value.size
    return total


def _find_modelfile(path: Path) -> tuple[Path, Path | None]:
    """(model folder, Modelfile or None) for a folder or a Modelfile path."""
    if path.is_file():
        return path.parent, path
    candidate = path / "Modelfile"
    return path, (candidate if candidate.is_file() else None)


def choose_renderer_name(explicit: str | None, modelfile_choice: str | None,
                         model: Model, has_template: bool) -> str | None:
    """Renderer choice, first match wins: argument, Modelfile, architecture default, jinja."""
    if explicit:
        return explicit
    if modelfile_choice:
        return modelfile_choice
    preferred = getattr(model, "default_renderer", None)
    if preferred and preferred in plugins.host().registry("renderers"):
        return preferred
    return "jinja" if has_template else None


def choose_parser_name(explicit: str | None, modelfile_choice: str | None, model: Model,
                       renderer_name: str | None) -> str | None:
    if explicit:
        return explicit
    if modelfile_choice:
        return modelfile_choice
    registry = plugins.host().registry("parsers")
    preferred = getattr(model, "default_parser", None)
    if preferred and preferred in registry:
        return preferred
    if renderer_name:
        family = renderer_name.split("-")[0]
        for name in (renderer_name, family):
            if name in registry:
                return name
    return None


def find_draft(folder: Path, explicit: str | Path | None, modelfile_draft: str | None
               ) -> Path | None:
    """Draft choice: argument, Modelfile DRAFT, the folder's ``draft/``, a bundle's tensors."""
    for chosen in (explicit, modelfile_draft):
        if chosen:
            path = Path(chosen).expanduser()
            if not path.exists() and str(chosen) not in plugins.host().registry("models"):
                raise ModelFolderError(f"{path}: draft folder not found")
            return resolve_model_path(chosen)
    if (folder / "draft" / "config.json").exists():
        return folder / "draft"
    return None


def load(path: str | Path, draft: str | Path | None = None, renderer: str | None = None, *,
         parser: str | None = None, dtype: str | mx.Dtype | None = None,
         use_draft: bool = True) -> Bundle:
    """Model, tokenizer, renderer, parser, draft and generation defaults of a model folder.

    ``path`` is a model folder, a Modelfile, or a registered model name.
    """
    from .chat import RenderContext, get_parser, get_renderer
    from .modelfile import read_modelfile
    from .sampler import SamplerOptions
    from .tokenizer import Tokenizer

    p = Path(path).expanduser()
    folder, modelfile_path = _find_modelfile(p if p.exists() else resolve_model_path(path))
    modelfile = read_modelfile(modelfile_path) if modelfile_path else None
    if modelfile is not None and modelfile.from_ and modelfile_path is not None:
        target = Path(modelfile.from_)
        if not target.is_absolute():
            target = modelfile_path.parent / target
        if target.resolve() != folder.resolve():
            folder = resolve_model_path(target if target.exists() else modelfile.from_)
    config = read_config(folder)
    model = load_model(folder, dtype=dtype)
    tokenizer = Tokenizer.from_folder(folder)

    template = tokenizer.chat_template
    renderer_name = choose_renderer_name(
        renderer, modelfile.renderer if modelfile else None, model, template is not None)
    context = RenderContext(
        model_name=str(config.get("_name_or_path") or folder.name),
        num_parameters=parameter_count(model),
        chat_template=template,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        special_tokens=dict(tokenizer.special_tokens),
    )
    renderer_obj = get_renderer(renderer_name, context) if renderer_name else None
    parser_name = choose_parser_name(parser, modelfile.parser if modelfile else None, model,
                                     renderer_name)
    parser_obj = get_parser(parser_name, context) if parser_name else None

    gen_config = folder / "generation_config.json"
    generation = _read_json(gen_config, "generation config") if gen_config.exists() else {}
    defaults = SamplerOptions.from_mapping(generation if isinstance(generation, dict) else {})
    params = dict(modelfile.parameters) if modelfile is not None else {}
    sampler_fields = set(SamplerOptions.__dataclass_fields__)
    defaults = defaults.merged({k: v for k, v in params.items() if k in sampler_fields})

    draft_obj, draft_path = None, None
    if use_draft:
        draft_path = find_draft(folder, draft, modelfile.draft if modelfile else None)
        from .drafts import load_draft

        if draft_path is not None:
            draft_obj = load_draft(draft_path, model)
        else:
            draft_obj = load_draft(folder, model, bundle=True)  # None when no draft.* tensors
    return Bundle(path=folder, config=config, model=model, tokenizer=tokenizer,
                  renderer=renderer_obj, renderer_name=renderer_name, parser=parser_obj,
                  parser_name=parser_name, draft=draft_obj, draft_path=draft_path,
                  defaults=defaults, modelfile=modelfile,
                  extra={"context": context, "max_tokens": params.get("num_predict"),
                         "stop": params.get("stop"),
                         "system": modelfile.system if modelfile else None})
