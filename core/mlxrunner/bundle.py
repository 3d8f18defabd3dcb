"""A whole model folder, ready to run: ``load(path)`` gives the :class:`Bundle` of model,
tokenizer, renderer, parser, draft and generation defaults.

It sits above the model, chat and decoding packages: it picks the chat format and the
draft (first match wins: the argument, the Modelfile, the architecture's default) and reads
the sampler defaults.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .chat.formats import RenderContext, get_parser, get_renderer
from .decode.options import SamplerOptions
from .errors import MediaError, MLXRunnerError, ModelfileError, ModelFolderError
from .host import manager as plugins
from .media import Encoder, decode_audio, decode_image, place_media
from .media.audio import AUDIO_SAMPLE_RATE
from .model.builtin_draft import load_checkpoint_draft
from .model.draft import BUNDLE_PREFIX, load_draft
from .model.gguf import gguf_tokenizer, is_gguf, load_gguf_model
from .model.interface import Model, weight_precision_of
from .model.loading import load_model, read_config, read_json, resolve_model_path, weight_files
from .model.modelfile import Modelfile, inherit_modelfile, read_modelfile
from .model.safetensors import FLOAT_DTYPES, stored_dtypes
from .model.tokenizer import Tokenizer


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
    _encoders: dict[str, Encoder] | None = field(default=None, repr=False)
    _encoders_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def encoders(self) -> Mapping[str, Encoder]:
        """The model's media encoders by modality (:meth:`Model.load_encoders`), loaded on
        first use, once."""
        with self._encoders_lock:
            if self._encoders is None:
                loaded = dict(self.model.load_encoders(self.path))
                for modality, encoder in loaded.items():
                    if encoder.modality != modality:
                        raise ModelFolderError(f"the {modality} encoder says it serves "
                                               f"{encoder.modality!r:.40}")
                self._encoders = loaded
            return self._encoders

    def capabilities(self) -> list[str]:
        """What the model takes, in Ollama's words: ``completion``; ``tools`` and
        ``thinking`` (a chat format with a reply parser); ``vision`` and ``audio`` (an
        encoder for images, for audio: loaded to tell)."""
        out = ["completion"]
        if self.renderer is not None and self.parser_name is not None:
            out += ["tools", "thinking"]
        try:
            encoders = self.encoders()
        except MLXRunnerError:  # (media this version does not run, or a broken tower)
            encoders = {}
        out += [name for kind, name in (("image", "vision"), ("audio", "audio"))
                if kind in encoders]
        return out

    def place_media(self, ids: Sequence[int], media: Sequence[tuple[str, bytes | Any]],
                    name: str | None = None) -> Sequence[int]:
        """``ids`` with ``media`` (``(modality, data)`` in the order the prompt's
        placeholders appear: a file's bytes, or an image's decoded ``[H, W, 3]`` pixels, an
        audio clip's float32 samples at 16 kHz)
        at their placeholders (:func:`mlxrunner.place_media`); ``ids`` themselves where
        there is none. One :class:`MediaError` line (naming the model as ``name``, else by
        its folder) for a model without an encoder for a modality, media that does not
        decode, or placeholders that do not match."""
        if not media:
            return ids
        encoders = self.encoders()
        items = []
        for modality, data in media:
            encoder = encoders.get(modality)
            if encoder is None:
                raise MediaError(f"{name or self.path.name} takes no {modality} input")
            if isinstance(data, (bytes, bytearray, memoryview)):
                decoded = decode_image(data) if modality == "image" else decode_audio(
                    data, sample_rate=getattr(encoder, "sample_rate", AUDIO_SAMPLE_RATE))
            else:
                decoded = np.asarray(data)
            items.append(encoder.prepare(decoded))
        return place_media(ids, items, {kind: encoders[kind].placeholder
                                        for kind, _ in media})

    def new_parser(self) -> Any | None:
        """A parser of its own for one reply (a parser holds the state of the reply it is
        parsing, so concurrent replies must not share one)."""
        if self.parser_name is None:
            return None
        return get_parser(self.parser_name, self.extra.get("context"))

    def stop_strings(self) -> list[str]:
        """The Modelfile's ``PARAMETER stop`` strings: a reply ends where one appears."""
        return list(self.extra.get("stop") or [])

    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end a reply: the tokenizer's EOS ids, the model's own, and the
        renderer's stop markers (e.g. an end-of-turn token)."""
        tok = self.tokenizer
        ids = set(tok.eos_ids) | set(self.model.eos_token_ids)
        for marker in getattr(self.renderer, "stop_markers", ()) or ():
            marker_id = tok.token_to_id(marker)
            if marker_id is not None:
                ids.add(marker_id)
        return frozenset(ids)


def weights_bytes(model: nn.Module) -> int:
    """The bytes of the model's arrays as loaded (quantized ones packed)."""
    from mlx.utils import tree_flatten

    flat = cast("list[tuple[str, Any]]", tree_flatten(model.parameters()))
    return sum(int(v.nbytes) for _, v in flat if isinstance(v, mx.array))


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


def stored_precision(bundle: Bundle, part: str = "target") -> str | None:
    """How the ``target``'s or the ``draft``'s weights are stored in the folder: their
    quantization (kept as stored when loaded), else the float dtypes of their tensors, which
    loading may cast (to the dtype config.json declares, or ``dtype``). None: no such part."""
    module = bundle.model if part == "target" else bundle.draft
    if module is None:
        return None
    loaded = weight_precision_of(module)
    gguf = bundle.extra.get("gguf")
    if part == "target" and gguf is not None:
        return f"GGUF {'/'.join(gguf.type_names())}"
    if "bit" in loaded:
        return loaded
    own: Callable[[str], bool]
    if part == "target":
        files, own = weight_files(bundle.path), lambda name: not name.startswith(BUNDLE_PREFIX)
    elif bundle.draft_path is None:  # a bundle's draft: the draft.* tensors beside the target's
        files, own = weight_files(bundle.path), lambda name: name.startswith(BUNDLE_PREFIX)
    else:
        files, own = weight_files(bundle.draft_path), lambda name: True
    names = {FLOAT_DTYPES[dtype] for f in files for name, dtype in stored_dtypes(f).items()
             if dtype in FLOAT_DTYPES and own(name)}
    return "/".join(sorted(names)) or loaded


def _find_modelfile(path: Path) -> tuple[Path, Path | None]:
    """(model folder, Modelfile or None) for a folder or a Modelfile path."""
    if path.is_file():
        return path.parent, path
    candidate = path / "Modelfile"
    # one that is there but no regular file (a FIFO) is read_modelfile's to refuse
    return path, (candidate if candidate.exists() else None)


def choose_renderer_name(explicit: str | None, modelfile_choice: str | None,
                         model: Model, has_template: bool) -> str | None:
    """Renderer choice, first match wins: argument, Modelfile, architecture default, jinja."""
    if explicit:
        return explicit
    if modelfile_choice:
        return modelfile_choice
    preferred = model.default_renderer
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
    preferred = model.default_parser
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
    """Draft choice: argument, Modelfile DRAFT, the folder's ``draft/``, a bundle's tensors.
    A chosen draft is a folder, a store name (a Hub repository once pulled) or a registered
    name, as a target is; one that is none of these is one line saying so."""
    for chosen in (explicit, modelfile_draft):
        if chosen:
            try:
                return resolve_model_path(chosen)
            except ModelFolderError as exc:
                said = str(exc).replace("model folder not found", "draft folder not found")
                raise ModelFolderError(said if said != str(exc) else f"draft: {exc}") \
                    from None
    if (folder / "draft" / "config.json").exists():
        return folder / "draft"
    return None


def load(path: str | Path, draft: str | Path | None = None, renderer: str | None = None, *,
         parser: str | None = None, dtype: str | mx.Dtype | None = None,
         use_draft: bool = True, distributed: str | None = None) -> Bundle:
    """Model, tokenizer, renderer, parser, draft and generation defaults of a model folder.

    ``path`` is a model folder, a Modelfile, a GGUF file or a registered model name.
    ``distributed`` (``tensor`` or ``pipeline``): this process is one rank of a job and
    loads its part of the target (:func:`mlxrunner.distributed.load_sharded`); the draft
    is replicated.
    """
    p = Path(path).expanduser()
    gguf_path: Path | None = p if is_gguf(p) else None
    if gguf_path is None and p.suffix.lower() == ".gguf" and not p.exists():
        raise ModelFolderError(f"{p}: no such GGUF file")
    if gguf_path is not None:
        folder, modelfile_path = p.parent, None
    else:
        folder, modelfile_path = _find_modelfile(p if p.exists() else resolve_model_path(path))
    modelfile = read_modelfile(modelfile_path) if modelfile_path else None
    # FROM another folder: the weights are there, and so is a Modelfile this one builds on
    # (followed FROM by FROM; a chain that comes back to a Modelfile is refused). FROM a
    # GGUF file: the weights, tokenizer and template are that file.
    current, seen = modelfile, set()
    while current is not None and current.from_ and current.path is not None:
        seen.add(current.path.resolve())
        target = Path(current.from_).expanduser()
        if not target.is_absolute():
            target = current.path.parent / target
        if is_gguf(target):
            gguf_path, folder = target, target.parent
            break
        if target.suffix.lower() == ".gguf":
            raise ModelFolderError(f"{current.path}: FROM {current.from_}: no such GGUF file")
        if target.resolve() == current.path.parent.resolve():
            break
        folder = resolve_model_path(target if target.exists() else current.from_)
        base_path = folder / "Modelfile"
        if not base_path.is_file():
            break
        if base_path.resolve() in seen:
            raise ModelfileError(f"{current.path}: FROM {current.from_} comes back to "
                                 f"{base_path}, which builds on this one")
        current = read_modelfile(base_path)
        modelfile = inherit_modelfile(cast(Modelfile, modelfile), current)
    gguf = None
    if gguf_path is not None and distributed is not None:
        raise ModelFolderError(f"{gguf_path}: a GGUF file does not load sharded (`mlxrunner "
                               f"convert {gguf_path.name} FOLDER` writes a safetensors "
                               "folder that does)")
    if gguf_path is not None:
        gguf, config, model = load_gguf_model(gguf_path, dtype)
        tokenizer = gguf_tokenizer(gguf)
        name = str(gguf.metadata.get("general.name") or gguf_path.stem)
    else:
        config = read_config(folder)
        if distributed is not None:
            from .distributed import load_sharded, world

            model = load_sharded(folder, distributed, world(), dtype=dtype)
        else:
            model = load_model(folder, dtype=dtype)
        tokenizer = Tokenizer.from_folder(folder)
        name = str(config.get("_name_or_path") or folder.name)

    template = tokenizer.chat_template
    renderer_name = choose_renderer_name(
        renderer, modelfile.renderer if modelfile else None, model, template is not None)
    context = RenderContext(
        model_name=name,
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
    generation = read_json(gen_config, "generation config") if gen_config.exists() else {}
    defaults = SamplerOptions.from_mapping(generation if isinstance(generation, dict) else {})
    params = dict(modelfile.parameters) if modelfile is not None else {}
    sampler_fields = set(SamplerOptions.__dataclass_fields__)
    defaults = defaults.merged({k: v for k, v in params.items() if k in sampler_fields})

    draft_obj, draft_path = None, None
    if use_draft:
        draft_path = find_draft(folder, draft, modelfile.draft if modelfile else None)
        # The draft computes in the target's dtype: its context is the target's tapped states,
        # and on a CPU a bfloat16 draft beside a float32 target misses the host's fast
        # float32 products
        if draft_path is not None:
            draft_obj = load_draft(draft_path, model, dtype=model.dtype)
        else:  # None when no draft.* tensors
            draft_obj = load_draft(folder, model, bundle=True, dtype=model.dtype)
        if draft_obj is None:  # a draft the checkpoint itself carries (an MTP head), if any
            draft_obj = load_checkpoint_draft(folder, model, dtype=dtype)
        if distributed is not None and getattr(draft_obj, "reads_target_caches", False):
            raise ModelFolderError(
                f"{draft_path or folder}: the draft {type(draft_obj).__name__} attends over "
                "the target's caches, which a distributed target splits over its ranks "
                "(--no-draft, or a DFlash draft)")
    return Bundle(path=folder, config=config, model=model, tokenizer=tokenizer,
                  renderer=renderer_obj, renderer_name=renderer_name, parser=parser_obj,
                  parser_name=parser_name, draft=draft_obj, draft_path=draft_path,
                  defaults=defaults, modelfile=modelfile,
                  extra={"context": context, "max_tokens": params.get("num_predict"),
                         "gguf": gguf,
                         "stop": params.get("stop"),
                         "system": modelfile.system if modelfile else None})


def context_length(bundle: Bundle) -> int | None:
    """The model's context (positions it was made for), where its config says."""
    configs = [bundle.config, bundle.config.get("text_config") or {}]
    for config in configs:
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions",
                    "seq_length"):
            value = config.get(key) if isinstance(config, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
