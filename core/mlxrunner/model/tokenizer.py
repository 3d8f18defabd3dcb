"""The tokenizer of a model folder: ``tokenizers`` plus the folder's special tokens.

A Hugging Face model folder spreads its tokenizer over several files:
``tokenizer.json`` (the ``tokenizers`` pipeline), ``tokenizer_config.json``
(named special tokens, ``add_bos_token``, maybe the chat template),
``chat_template.jinja`` and the end-of-sequence ids of ``config.json`` and
``generation_config.json``. :class:`Tokenizer` reads them all and offers
encoding, decoding and streaming detokenisation that never splits a UTF-8
character or a special marker.
"""

from __future__ import annotations

import gzip
import json
import warnings
from collections.abc import Iterable, Mapping
from os import PathLike
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tokenizers

from ..errors import ModelFolderError, TokenizerInputError

__all__ = ["Tokenizer", "StreamingDetokenizer"]

_REPLACEMENT = "\ufffd"
_ROLES = ("bos", "eos", "pad", "unk")


def _one_line(text: str) -> str:
    first = str(text).strip().splitlines()
    return first[0] if first else "unknown error"


def _read_json(path: Path) -> Any:
    """A JSON file's value, or None when the file is absent."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ModelFolderError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise ModelFolderError(
            f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
        ) from None
    except OSError as err:
        raise ModelFolderError(f"{path}: cannot be read ({err.strerror or err})") from None


def _read_json_object(path: Path) -> dict[str, Any] | None:
    value = _read_json(path)
    if value is not None and not isinstance(value, dict):
        raise ModelFolderError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _eos_ids_from(value: Any, where: str) -> list[int]:
    """``eos_token_id`` as written in config files: absent, an int, or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for item in values:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ModelFolderError(
                f"{where}: eos_token_id must be a token id or a list of token ids, got {value!r}"
            )
    return list(values)


def _token_content(value: Any, where: str) -> str | None:
    """A special token as tokenizer_config writes it: a string, an AddedToken dict or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ModelFolderError(f"{where}: expected a token string, got {value!r}")


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise ModelFolderError(f"{path}: file not found (a model folder needs tokenizer.json)")
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                backend = tokenizers.Tokenizer.from_str(handle.read())
        else:
            backend = tokenizers.Tokenizer.from_file(str(path))
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise ModelFolderError(f"{path}: cannot be read ({_one_line(str(err))})") from None
    except Exception as err:  # tokenizers raises plain Exception for a bad file
        raise ModelFolderError(
            f"{path}: not a valid tokenizer.json ({_one_line(str(err))})"
        ) from None
    # A tokenizer.json may carry training-time truncation or padding; we never want either.
    backend.no_truncation()
    backend.no_padding()
    return backend


def _decoder_types(backend: tokenizers.Tokenizer) -> set[str]:
    """The ``type`` of every component of the backend's decoder (nested sequences included)."""
    if backend.decoder is None:
        return set()
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(json.loads(backend.decoder.__getstate__()))
    return found


def _pick_chat_template(value: Any, where: str) -> tuple[str | None, dict[str, str]]:
    """``chat_template`` as a string, or a list of ``{"name", "template"}`` (pick "default")."""
    if value is None:
        return None, {}
    if isinstance(value, str):
        return value, {"default": value}
    if isinstance(value, list):
        named: dict[str, str] = {}
        for item in value:
            if not (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                raise ModelFolderError(
                    f"{where}: chat_template list entries need a 'name' and a 'template' string"
                )
            named[item["name"]] = item["template"]
        return named.get("default"), named
    raise ModelFolderError(
        f"{where}: chat_template must be a string or a list of named templates, "
        f"got {type(value).__name__}"
    )


class Tokenizer:
    """Encode, decode and stream-detokenize for one model.

    Build it with :meth:`from_folder` (a Hugging Face model folder) or
    :meth:`from_file` (a bare ``tokenizer.json``, optionally gzipped).
    """

    #: the longest text encode() takes: far past any context window, far below what makes
    #: the Rust tokenizer run out of memory
    max_encode_chars = 64 * 2**20

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        config: Mapping[str, Any] | None = None,
        eos_ids: Iterable[int] = (),
        chat_template: str | list[dict[str, str]] | None = None,
        source: str = "tokenizer_config.json",
    ) -> None:
        """Wrap a ``tokenizers.Tokenizer``.

        ``config`` is the parsed tokenizer_config.json; ``eos_ids`` are extra
        end-of-sequence ids (from config.json / generation_config.json);
        ``chat_template`` overrides the config's template; ``source`` names the
        config in error messages.
        """
        self._backend = backend
        config = dict(config or {})

        backend_added = {
            added.content: (token_id, bool(added.special))
            for token_id, added in backend.get_added_tokens_decoder().items()
        }
        special = {
            content: tid for content, (tid, is_special) in backend_added.items() if is_special
        }

        decoder_entries = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder_entries, dict):
            raise ModelFolderError(f"{source}: added_tokens_decoder must be an object")
        for key, entry in decoder_entries.items():
            content = _token_content(entry, f"{source}: added_tokens_decoder[{key}]")
            try:
                declared = int(key)
            except ValueError:
                raise ModelFolderError(
                    f"{source}: added_tokens_decoder key {key!r} is not a token id"
                ) from None
            actual = backend.token_to_id(content) if content is not None else None
            if content is None or actual is None:
                warnings.warn(
                    f"{source}: added token {content!r} (id {declared}) is not in "
                    "tokenizer.json; ignored",
                    stacklevel=2,
                )
                continue
            if actual != declared:
                raise ModelFolderError(
                    f"{source}: added token {content!r} has id {declared} but tokenizer.json "
                    f"gives it id {actual}"
                )
            if isinstance(entry, dict) and entry.get("special"):
                special[content] = actual

        roles: dict[str, tuple[str | None, int | None]] = {}
        for role in _ROLES:
            content = _token_content(config.get(f"{role}_token"), f"{source}: {role}_token")
            token_id = backend.token_to_id(content) if content is not None else None
            if content is not None and token_id is None:
                message = f"{source}: {role}_token {content!r} is not in tokenizer.json"
                if role in ("bos", "eos"):
                    raise ModelFolderError(message)
                warnings.warn(message + "; ignored", stacklevel=2)
                content = None
            if content is not None and token_id is not None:
                special[content] = token_id
            roles[role] = (content, token_id)
        self._roles = roles

        add_bos = config.get("add_bos_token", False)
        if not isinstance(add_bos, bool):
            raise ModelFolderError(f"{source}: add_bos_token must be true or false")
        if add_bos and roles["bos"][1] is None:
            raise ModelFolderError(f"{source}: add_bos_token is true but there is no bos_token")
        self._add_bos = add_bos

        all_eos = set(eos_ids)
        if roles["eos"][1] is not None:
            all_eos.add(roles["eos"][1])
        self._eos_ids = frozenset(all_eos)
        self._special = MappingProxyType(dict(sorted(special.items(), key=lambda kv: kv[1])))

        template_value = chat_template if chat_template is not None else config.get("chat_template")
        self._chat_template, named = _pick_chat_template(template_value, source)
        self._chat_templates = MappingProxyType(named)

        # What the streaming detokenizer needs to know about the decoder.
        # decode(skip_special_tokens=True) skips exactly tokenizer.json's special added tokens
        self._skip_ids = frozenset(tid for tid, is_special in backend_added.values() if is_special)
        byte_ids: set[int] = set()
        if "ByteFallback" in _decoder_types(backend):
            for byte in range(256):
                token_id = backend.token_to_id(f"<0x{byte:02X}>")
                if token_id is not None:
                    byte_ids.add(token_id)
        self._byte_fallback_ids = frozenset(byte_ids)

    # ----------------------------------------------------------------- building

    @classmethod
    def from_file(
        cls,
        tokenizer_json: str | PathLike[str],
        *,
        config: Mapping[str, Any] | None = None,
        eos_ids: Iterable[int] = (),
        chat_template: str | list[dict[str, str]] | None = None,
    ) -> Tokenizer:
        """A tokenizer from one ``tokenizer.json`` (or ``tokenizer.json.gz``) file.

        ``config`` is a tokenizer_config.json mapping (optional); ``eos_ids``
        adds end-of-sequence ids; ``chat_template`` sets the template.
        """
        backend = _load_backend(Path(tokenizer_json))
        return cls(backend, config=config, eos_ids=eos_ids, chat_template=chat_template)

    @classmethod
    def from_folder(cls, path: str | PathLike[str]) -> Tokenizer:
        """The tokenizer of a Hugging Face model folder.

        Reads tokenizer.json (required), tokenizer_config.json, chat_template.jinja
        (or chat_template.json), and the ``eos_token_id`` of config.json (also
        inside ``text_config``) and generation_config.json.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise ModelFolderError(f"{folder}: not a folder")
        tokenizer_json = folder / "tokenizer.json"
        if not tokenizer_json.is_file() and (folder / "tokenizer.json.gz").is_file():
            tokenizer_json = folder / "tokenizer.json.gz"
        backend = _load_backend(tokenizer_json)

        config_path = folder / "tokenizer_config.json"
        config = _read_json_object(config_path) or {}

        eos: list[int] = []
        model_config_path = folder / "config.json"
        model_config = _read_json_object(model_config_path) or {}
        eos += _eos_ids_from(model_config.get("eos_token_id"), str(model_config_path))
        text_config = model_config.get("text_config")
        if isinstance(text_config, dict):
            eos += _eos_ids_from(
                text_config.get("eos_token_id"), f"{model_config_path} (text_config)"
            )
        generation_path = folder / "generation_config.json"
        generation = _read_json_object(generation_path) or {}
        eos += _eos_ids_from(generation.get("eos_token_id"), str(generation_path))

        chat_template: str | list[dict[str, str]] | None = None
        jinja_path = folder / "chat_template.jinja"
        json_template_path = folder / "chat_template.json"
        if jinja_path.is_file():
            try:
                chat_template = jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise ModelFolderError(
                    f"{jinja_path}: cannot be read ({_one_line(str(err))})"
                ) from None
        elif json_template_path.is_file():
            chat_template = (_read_json_object(json_template_path) or {}).get("chat_template")
            if chat_template is None:
                raise ModelFolderError(f"{json_template_path}: has no 'chat_template' entry")

        return cls(
            backend,
            config=config,
            eos_ids=eos,
            chat_template=chat_template,
            source=str(config_path),
        )

    # --------------------------------------------------------------- properties

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """How many token ids the tokenizer knows, added tokens included.

        A model's embedding table may be larger (Qwen3.5 pads to 248320).
        """
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends generation: the config files' and tokenizer_config's eos."""
        return self._eos_ids

    @property
    def bos_token(self) -> str | None:
        return self._roles["bos"][0]

    @property
    def bos_id(self) -> int | None:
        return self._roles["bos"][1]

    @property
    def eos_token(self) -> str | None:
        return self._roles["eos"][0]

    @property
    def eos_id(self) -> int | None:
        """The id of tokenizer_config's ``eos_token`` (see :attr:`eos_ids` for all)."""
        return self._roles["eos"][1]

    @property
    def pad_token(self) -> str | None:
        return self._roles["pad"][0]

    @property
    def pad_id(self) -> int | None:
        return self._roles["pad"][1]

    @property
    def unk_token(self) -> str | None:
        return self._roles["unk"][0]

    @property
    def unk_id(self) -> int | None:
        return self._roles["unk"][1]

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(..., add_special_tokens=True)`` puts the BOS token first."""
        return self._add_bos

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """Special token text -> id (tokenizer.json's special added tokens, the
        tokenizer_config's special added tokens and its bos/eos/pad/unk)."""
        return self._special

    @property
    def chat_template(self) -> str | None:
        """The folder's default chat template (Jinja source), if it has one."""
        return self._chat_template

    @property
    def chat_templates(self) -> Mapping[str, str]:
        """Every named chat template ("default" among them when there is one)."""
        return self._chat_templates

    # --------------------------------------------------------------- operations

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for ``text``. Special markers written in the text (``<|im_start|>``)
        become their single id. With ``add_special_tokens``, tokenizer.json's
        post-processor runs and the BOS token is put first when ``add_bos_token``
        says so (not twice when the text already starts with it)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}")
        if len(text) > self.max_encode_chars:
            raise TokenizerInputError(f"a text of {len(text)} characters is longer than the "
                                      f"tokenizer takes ({self.max_encode_chars})")
        try:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except BaseException as exc:
            # A panic in the Rust code arrives as pyo3's PanicException, a BaseException.
            if type(exc).__name__ != "PanicException":
                raise
            raise TokenizerInputError(f"the tokenizer failed on a text of {len(text)} "
                                      f"characters ({str(exc)[:200]})") from None
        bos_id = self.bos_id
        if add_special_tokens and self._add_bos and (not ids or ids[0] != bos_id):
            assert bos_id is not None  # add_bos_token without a bos_token fails on load
            ids.insert(0, bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; ids the tokenizer does not know decode to nothing."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        """A fresh streaming detokenizer (one per generated sequence)."""
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos_ids={sorted(self.eos_ids)})"
        )


class StreamingDetokenizer:
    """Turns token ids into text one id at a time.

    ``add(id)`` returns the text that became final with that id (often ""),
    ``finish()`` the rest. Joined, the pieces equal ``Tokenizer.decode`` of all
    ids exactly. Text is held back while it could still change: when it ends
    in U+FFFD (an incomplete UTF-8 sequence from byte-level BPE) or in a run of
    byte-fallback tokens (``<0xE2>``: a later invalid byte turns the whole run
    into U+FFFD). Special tokens come out whole, as they decode to whole text.

    Only a window of recent ids is decoded each step: the ids since the last
    emitted text plus those of the previous emission (the context decoders
    such as ``Strip`` or Metaspace need to treat the window's first token as
    not the first). The cost per id is constant for real text; it grows only
    with the length of a held-back run.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._backend = tokenizer.backend
        # Dropping skipped ids here (rather than decoding with skip_special_tokens)
        # keeps byte runs on both sides of a skipped token joined, as decode() does.
        self._skip_ids = tokenizer._skip_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer._byte_fallback_ids
        self._window: list[int] = []
        self._emitted_in_window = 0  # leading ids of the window whose text is out
        self._window_prefix = ""  # decode(window[:emitted_in_window])
        self._finished = False

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=False)

    def add(self, token_id: int) -> str:
        """Take one id; return the text that is now final (possibly "")."""
        if self._finished:
            raise RuntimeError("add() after finish(): start a new detokenizer")
        if token_id in self._skip_ids or self._backend.id_to_token(token_id) is None:
            return ""  # decode() drops these too
        self._window.append(token_id)
        if token_id in self._byte_ids:
            return ""
        text = self._decode(self._window)
        if text.endswith(_REPLACEMENT) or not text.startswith(self._window_prefix):
            return ""
        new_text = text[len(self._window_prefix) :]
        tail = self._window[self._emitted_in_window :]
        tail_text = self._decode(tail)
        if tail_text:
            self._window = tail
            self._window_prefix = tail_text
        else:
            # Keep the older context: a window whose prefix decodes to "" would let a
            # leading-space Strip eat text that decode() keeps.
            self._window_prefix = text
        self._emitted_in_window = len(self._window)
        return new_text

    def finish(self) -> str:
        """End the stream; return whatever text was still held back."""
        if self._finished:
            return ""
        self._finished = True
        text = self._decode(self._window)
        return text[len(self._window_prefix) :]
