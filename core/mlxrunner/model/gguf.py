"""GGUF files (llama.cpp's one-file format) as model sources.

A GGUF file holds the weights, the architecture's hyperparameters and the tokenizer with its
chat template. It is untrusted like any model folder: the header is parsed here, bounded,
and every tensor's byte range is checked to lie inside the data region without overlapping
another before MLX maps the file. MLX's own loader reads F32, F16, Q4_0, Q4_1 and Q8_0
(the quantized ones as MLX affine tensors, group 32, which quantized matrix products use
as they are); BF16 is read here (MLX's loader turns it into float16, which can overflow);
other types are dequantized with the ``gguf`` package when it is installed.

What the hyperparameters mean and what the tensors are called is the architecture's
knowledge: its model class implements ``from_gguf(metadata, tensors)`` and returns the
``config.json`` it amounts to with the tensors under its checkpoint names.
"""

from __future__ import annotations

import logging
import mmap
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np

from ..errors import ModelFolderError, UnknownNameError
from .interface import Model, reads_gguf

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
SUFFIX = ".gguf"
_MAX_COUNT = 1 << 24          # tensors or metadata entries: far past any real file
_MAX_STRING = 1 << 26         # one string (a chat template, a token)
_MAX_ARRAY = 1 << 24          # one array's elements (vocabularies, merges)
_DEFAULT_ALIGNMENT = 32

# Metadata value types: id -> (struct format, numpy dtype) for the fixed-size ones.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9

#: ggml tensor types: id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
#: what MLX's loader reads as it is stored
NATIVE_TYPES = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # numpy order: the last axis is GGUF's first dimension
    type_name: str
    offset: int              # from the start of the file
    nbytes: int


@dataclass
class GGUFFile:
    """One parsed file: its metadata (plain Python values) and tensor directory."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ModelFolderError(f"{self.path}: GGUF metadata names no general.architecture")
        return arch

    def type_names(self) -> list[str]:
        """The tensor types present, most common first."""
        counts: dict[str, int] = {}
        for info in self.tensors.values():
            counts[info.type_name] = counts.get(info.type_name, 0) + 1
        return sorted(counts, key=lambda name: -counts[name])


class _Reader:
    """Bounded little-endian reads from a memory-mapped header."""

    def __init__(self, path: Path, data: mmap.mmap) -> None:
        self.path, self.data, self.pos = path, data, 0

    def fail(self, problem: str) -> ModelFolderError:
        return ModelFolderError(f"{self.path}: corrupt GGUF file ({problem})")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"truncated at byte {self.pos}")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str, limit: int) -> int:
        n = self.scalar("<Q")
        if n > limit:
            raise self.fail(f"{what} {n} is past the limit {limit}")
        return int(n)

    def string(self) -> str:
        raw = self.take(self.count("a string of length", _MAX_STRING))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"a string at byte {self.pos - len(raw)} is not UTF-8") from None

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            if depth > 2:
                raise self.fail("arrays nested too deeply")
            inner = self.scalar("<I")
            n = self.count("an array of length", _MAX_ARRAY)
            if inner in _SCALARS:
                fmt, dtype = _SCALARS[inner]
                size = struct.calcsize(fmt)
                raw = self.take(n * size)
                return np.frombuffer(raw, dtype=dtype).tolist()
            return [self.value(inner, depth + 1) for _ in range(n)]
        raise self.fail(f"unknown metadata value type {kind}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse and check a GGUF file's header: metadata and the tensors' byte ranges."""
    p = Path(path)
    try:
        if not stat.S_ISREG(p.stat().st_mode):  # a FIFO would block, a device never end
            raise ModelFolderError(f"{p}: not a regular file")
        f = p.open("rb")
    except OSError as exc:
        raise ModelFolderError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    with f:
        size = p.stat().st_size
        if size < 24:
            raise ModelFolderError(f"{p}: not a GGUF file (only {size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            r = _Reader(p, data)
            if r.take(4) != MAGIC:
                raise ModelFolderError(f"{p}: not a GGUF file (no GGUF magic)")
            version = r.scalar("<I")
            if version not in (2, 3):
                raise ModelFolderError(f"{p}: GGUF version {version} is not supported "
                                       "(2 and 3 are)")
            n_tensors = r.count("tensor count", _MAX_COUNT)
            n_kv = r.count("metadata count", _MAX_COUNT)
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = r.string()
                metadata[key] = r.value(r.scalar("<I"))
            infos: list[tuple[str, tuple[int, ...], int, int]] = []
            for _ in range(n_tensors):
                name = r.string()
                n_dims = r.scalar("<I")
                if n_dims > 8:
                    raise r.fail(f"tensor {name!r:.80} has {n_dims} dimensions")
                dims = tuple(int(r.scalar("<Q")) for _ in range(n_dims))
                infos.append((name, dims, r.scalar("<I"), int(r.scalar("<Q"))))
            alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
            if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
                raise r.fail(f"general.alignment {alignment!r} is not a power of two")
            data_start = -(-r.pos // alignment) * alignment
    gguf = GGUFFile(path=p, version=version, metadata=metadata)
    spans: list[tuple[int, int, str]] = []
    for name, dims, type_id, offset in infos:
        if name in gguf.tensors:
            raise ModelFolderError(f"{p}: corrupt GGUF file (tensor {name!r:.80} twice)")
        kind = GGML_TYPES.get(type_id)
        if kind is None:
            raise ModelFolderError(f"{p}: tensor {name!r:.80} has unknown ggml type {type_id}")
        type_name, block, block_bytes = kind
        elements = 1
        for d in dims:
            elements *= d
        if dims and dims[0] % block:
            raise ModelFolderError(f"{p}: corrupt GGUF file (tensor {name!r:.80}: a row of "
                                   f"{dims[0]} is not whole {type_name} blocks)")
        nbytes = elements // block * block_bytes
        start = data_start + offset
        if offset % alignment or start + nbytes > size:
            raise ModelFolderError(f"{p}: corrupt or truncated GGUF file (tensor "
                                   f"{name!r:.80} lies outside the data)")
        spans.append((start, start + nbytes, name))
        gguf.tensors[name] = TensorInfo(name, tuple(reversed(dims)), type_name, start, nbytes)
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ModelFolderError(f"{p}: corrupt GGUF file (tensors {first!r:.80} and "
                                   f"{second!r:.80} overlap)")
    return gguf


def _mlx_name(name: str, suffix: str) -> str:
    """The name MLX's loader gives a quantized tensor's parts (``x.weight`` ->
    ``x.scales``)."""
    base = name[:-len(".weight")] if name.endswith(".weight") else name
    return f"{base}.{suffix}"


def _bf16(gguf: GGUFFile, info: TensorInfo) -> mx.array:
    raw = np.fromfile(gguf.path, dtype="<u2", count=info.nbytes // 2, offset=info.offset)
    return mx.array(raw.reshape(info.shape)).view(mx.bfloat16)


def _dequantized(gguf: GGUFFile, names: list[str]) -> dict[str, mx.array]:
    """Tensors of types MLX cannot read, dequantized to float32 with the gguf package."""
    kinds = sorted({gguf.tensors[n].type_name for n in names})
    try:
        from gguf import GGMLQuantizationType, quants
    except ImportError:
        raise ModelFolderError(
            f"{gguf.path}: tensors of type {', '.join(kinds)} need the gguf package to be "
            "read (pip install gguf); F32, F16, BF16, Q4_0, Q4_1 and Q8_0 need nothing"
        ) from None
    log.info("%s: dequantizing %d tensors of type %s to float32", gguf.path.name, len(names),
             ", ".join(kinds))
    out: dict[str, mx.array] = {}
    for name in names:
        info = gguf.tensors[name]
        raw = np.fromfile(gguf.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        try:
            values = quants.dequantize(raw, GGMLQuantizationType[info.type_name])
        except (NotImplementedError, KeyError, ValueError) as exc:
            raise ModelFolderError(f"{gguf.path}: tensor {name!r:.80} of type "
                                   f"{info.type_name} cannot be read ({exc})") from None
        out[name] = mx.array(np.asarray(values, dtype=np.float32).reshape(info.shape))
    return out


def read_gguf_tensors(gguf: GGUFFile) -> dict[str, mx.array]:
    """Every tensor of a checked file: quantized ones as MLX affine triples (``weight``,
    ``scales``, ``biases``), the rest as float arrays."""
    foreign = [n for n, info in gguf.tensors.items() if info.type_name not in NATIVE_TYPES]
    bf16 = [n for n in foreign if gguf.tensors[n].type_name == "BF16"]
    other = [n for n in foreign if n not in bf16]
    tensors: dict[str, mx.array] = {}
    if not other:
        # MLX maps the file itself (quantized blocks become its affine layout, no copy of
        # the file in Python); its BF16 conversion is replaced below.
        try:
            loaded = mx.load(str(gguf.path))
        except Exception as exc:  # MLX reports a bad file with assorted errors
            raise ModelFolderError(f"{gguf.path}: cannot load GGUF ({exc})") from None
        tensors.update(loaded)  # type: ignore[arg-type]
    else:
        # MLX's loader refuses the whole file when one tensor is of a type it lacks: the
        # native ones are dequantized too then (correct, larger in memory).
        log.info("%s: holds %s tensors, which MLX cannot read as stored", gguf.path.name,
                 ", ".join(sorted({gguf.tensors[n].type_name for n in other})))
        tensors.update(_dequantized(gguf, [n for n in gguf.tensors if n not in bf16]))
    for name in bf16:
        tensors[name] = _bf16(gguf, gguf.tensors[name])
    for name, info in gguf.tensors.items():
        if name not in tensors and _mlx_name(name, "scales") not in tensors:
            raise ModelFolderError(f"{gguf.path}: tensor {name!r:.80} ({info.type_name}) "
                                   "was not read")
    return tensors


def gguf_source(path: str | Path) -> tuple[GGUFFile, dict[str, Any], dict[str, mx.array]]:
    """(the file, the config.json it amounts to, its tensors under checkpoint names), through
    the ``from_gguf`` of the architecture its metadata names."""
    from ..host import manager as plugins

    gguf = read_gguf(path)
    arch = gguf.architecture
    try:
        cls = plugins.architecture_for({"model_type": arch})
    except UnknownNameError as exc:
        raise UnknownNameError(f"{gguf.path}: GGUF {exc}") from None
    if not reads_gguf(cls):
        raise ModelFolderError(f"{gguf.path}: the {arch!r:.80} architecture plugin does not "
                               "read GGUF files")
    tensors = read_gguf_tensors(gguf)
    try:
        config, weights = cast("type[Model]", cls).from_gguf(gguf.metadata, tensors)
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelFolderError(f"{gguf.path}: GGUF file does not fit the {arch} architecture "
                               f"({exc})") from None
    if any(v.dtype == mx.uint32 for k, v in weights.items() if k.endswith(".weight")):
        # quantize_for_checkpoint reads each module's bits off its packed tensors
        config.setdefault("quantization", {"group_size": 32, "bits": 4, "mode": "affine"})
    # Float32 compute unless asked otherwise: these files store float16 scales and float32
    # norms, and float16 activations go wrong on small llama models (and are slow on CPUs).
    config.setdefault("dtype", "float32")
    return gguf, config, weights



# Byte-level BPE pre-tokenizers by ``tokenizer.ggml.pre``: the split llama.cpp applies before
# the byte mapping (its pre-tokenizer types; the regexes are the published ones).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = ("default", "gpt-2", "gpt2", "olmo", "jais")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva")
_SPLIT_PRE = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
              "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str, where: Path) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    known = ", ".join(sorted({*_GPT2_PRE, *_DIGITS_THEN_GPT2_PRE, *_SPLIT_PRE}))
    raise ModelFolderError(f"{where}: GGUF pre-tokenizer {pre!r:.60} is not supported "
                           f"(supported: {known})")


def gguf_tokenizer(gguf: GGUFFile) -> Any:
    """The :class:`~mlxrunner.model.tokenizer.Tokenizer` a GGUF file's metadata describes
    (byte-level BPE, ``tokenizer.ggml.model`` gpt2), with its chat template."""
    import tokenizers
    from tokenizers import AddedToken, decoders, models

    from .tokenizer import Tokenizer

    meta, where = gguf.metadata, gguf.path
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelFolderError(
            f"{where}: GGUF tokenizer model {kind!r:.60} is not supported (byte-level BPE, "
            "'gpt2', is)")
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelFolderError(f"{where}: GGUF metadata has no tokenizer.ggml.tokens list")
    if not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1
                                               for m in merges):
        raise ModelFolderError(f"{where}: GGUF tokenizer.ggml.merges is not a list of pairs")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelFolderError(f"{where}: GGUF tokenizer.ggml.tokens repeats a token")
    pairs = [tuple(m.split(" ")) for m in merges]
    try:
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    except Exception as exc:  # the Rust side names a merge of unknown tokens
        raise ModelFolderError(f"{where}: GGUF tokenizer cannot be built ({exc})") from None
    backend.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")),
                                           where)
    backend.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    if isinstance(types, list) and len(types) == len(tokens):
        backend.add_special_tokens([
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types) if t == _CONTROL])
        backend.add_tokens([
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == _USER_DEFINED])

    def token_of(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        if index is None:
            return None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(tokens):
            raise ModelFolderError(f"{where}: GGUF tokenizer.ggml.{key}_token_id {index!r:.40} "
                                   "is not a token")
        return str(tokens[index])

    config: dict[str, Any] = {f"{role}_token": token_of(role)
                              for role in ("bos", "eos", "pad", "unk")}
    config = {k: v for k, v in config.items() if v is not None}
    add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
    config["add_bos_token"] = bool(add_bos) and "bos_token" in config
    extra_eos = [tokens.index(t) for t in (token_of("eot"), token_of("eom")) if t is not None]
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelFolderError(f"{where}: GGUF tokenizer.chat_template is not text")
    return Tokenizer(backend, config=config, eos_ids=extra_eos, chat_template=template,
                     source=str(where))


def load_gguf_model(path: str | Path, dtype: str | mx.Dtype | None = None
                    ) -> tuple[GGUFFile, dict[str, Any], Any]:
    """(the file, its config, the target Model with its weights), computed in ``dtype`` if
    given, else float32."""
    from .loading import build_model, declared_dtype, install_weights

    gguf, config, weights = gguf_source(path)
    model = build_model(config, str(gguf.path))
    install_weights(model, config, weights, gguf.path,
                    dtype if dtype is not None else declared_dtype(config))
    return gguf, config, model


def is_gguf(path: str | Path) -> bool:
    """A file named ``*.gguf`` (what a path or ``FROM`` means as a GGUF model)."""
    p = Path(path)
    return p.suffix.lower() == SUFFIX and p.is_file()
