"""``mlxrunner run [MODEL]`` without a prompt, at a terminal: a conversation, as ``ollama run``.

Each turn renders the whole conversation with the model's renderer, decodes the reply
(speculatively when the model has a draft; the model's prefix cache holds the conversation
so far, so a turn prefills only what is new: see :class:`mlxrunner.cache.PrefixCache`),
streams it through the model's parser (thinking shown dimmed, tool calls as JSON lines)
and keeps the parsed reply as the assistant's message for the next turn.

A message is one line, or the lines between a line opening with ``\"\"\"`` and one ending
with it (``\"\"\"text\"\"\"`` on one line too). Lines starting with ``/`` are commands (see
``COMMANDS``) and never reach the model. Ctrl-C during a reply ends it after the current
token and keeps what was written as the assistant's message, so the conversation goes on
as the user saw it (a second Ctrl-C abandons the reply and the message that asked for it);
Ctrl-C at the prompt only says how to leave; Ctrl-D or ``/bye`` leaves.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import FrameType
from typing import Any

from ..batch.generation import generate
from ..bundle import weights_bytes
from ..cache import prefix_cache_for
from ..chat.formats import ParsedMessage, media_parts
from ..chat.streaming import TextStream
from ..decode.options import OPTION_HELP, SamplerOptionError, SamplerOptions
from ..errors import MediaError, MLXRunnerError
from ..host import plugin_code
from ..media import MAX_AUDIO_BYTES, read_image
from ..media.files import read_media_file
from . import streamed
from .conversation import (
    SavedConversation,
    conversation_file,
    load_conversation,
    save_conversation,
)
from .statistics import describe_run

PROMPT = ">>> "
CONTINUATION = "... "
QUOTES = '"""'
SET_SYSTEM = "/set system"
HELP = 'Send a message (/? for help, """ to begin several lines, Ctrl+D or /bye to leave).'
EXIT_HINT = "Use Ctrl + d or /bye to exit."
DIM, RESET = "\x1b[2m", "\x1b[0m"

COMMANDS = """Available commands:
  /set            Set session variables (/? set)
  /show           Show model information (/? show)
  /save NAME      Save the conversation and its parameters
  /load NAME      Load a saved conversation
  /image PATH     Show the model an image with the next message (a path to an image
                  file in a message does the same)
  /audio PATH     Have the model hear an audio clip with the next message
  /clear          Forget the conversation (the system message stays)
  /bye            Exit
  /?, /help       Help for a command (/? set, /? show, /? shortcuts)

Use \"\"\" to begin a multi-line message."""

SET_HELP = """Available /set commands:
  /set parameter NAME VALUE   Set a parameter (/set parameter alone lists them)
  /set system TEXT            Set the system message (\"\"\" for several lines)
  /set think | nothink        Thinking on or off
  /set verbose | quiet        Statistics after each reply, or none"""

SHOW_HELP = """Available /show commands:
  /show info         The model, its draft and the conversation's length
  /show parameters   The parameters replies are decoded with
  /show system       The system message
  /show template     The chat template
  /show modelfile    The model's Modelfile"""

SHORTCUTS = """Available keyboard shortcuts:
  Up / Down          Previous / next line of the history
  Ctrl + c           Stop the reply (what was written is kept)
  Ctrl + d           Exit (at an empty prompt)
  Ctrl + a / e       Move to the start / end of the line
  Ctrl + w / u       Delete the word / the line before the cursor"""

#: what Tab completes at the prompt, word by word
COMPLETIONS = [
    "/set parameter", "/set system", "/set think", "/set nothink", "/set verbose",
    "/set quiet", "/show info", "/show parameters", "/show system", "/show template",
    "/show modelfile", "/save", "/load", "/image", "/audio", "/clear", "/bye", "/help",
    "/? set", "/? show",
    "/? shortcuts",
]

#: ``/set parameter`` names beyond the sampler's options
EXTRA_PARAMETERS = {
    "num_predict": "the most tokens a reply may have",
    "stop": "strings that end a reply (one or more, space-separated)",
}


@dataclass
class Reply:
    """One decoded reply: the parsed message, the decoding's statistics, and whether Ctrl-C
    ended it."""

    message: ParsedMessage
    stats: dict[str, Any]
    interrupted: bool = False


class _ReplyInterrupt:
    """Ctrl-C while a reply decodes: the first asks it to end after the current token (the
    decoding loop polls ``requested``), a second raises KeyboardInterrupt at once. Only the
    main thread can take signals; elsewhere Ctrl-C stays Python's KeyboardInterrupt."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False
        self._terminal: list[Any] | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> _ReplyInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        self._terminal = _echo_control_characters(False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._terminal is not None:
            _restore_terminal(self._terminal)
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)


def _echo_control_characters(on: bool) -> list[Any] | None:
    """Turn the terminal's echo of Ctrl-C as ``^C`` off (or on), so that a stopped reply is
    not cut by it; returns the settings to restore (None: stdin is no terminal)."""
    try:
        import termios
    except ImportError:  # not POSIX
        return None
    try:
        fd = sys.stdin.fileno()
        if not os.isatty(fd):
            return None
        saved = termios.tcgetattr(fd)
        changed = list(saved)
        changed[3] = saved[3] | termios.ECHOCTL if on else saved[3] & ~termios.ECHOCTL
        termios.tcsetattr(fd, termios.TCSANOW, changed)
        return saved
    except (termios.error, AttributeError, OSError, ValueError):
        return None


def _restore_terminal(saved: list[Any]) -> None:
    import termios

    try:
        termios.tcsetattr(sys.stdin.fileno(), termios.TCSANOW, saved)
    except (termios.error, OSError, ValueError):
        pass


class ChatSession:
    """A conversation's state and the commands that change it."""

    def __init__(self, bundle: Any, options: SamplerOptions, *, max_tokens: int,
                 think: bool | None, system: str | None, write: Callable[[str], Any],
                 color: bool, verbose: bool, conversations: Path | None,
                 name: str | None = None) -> None:
        self.bundle, self.options, self.max_tokens = bundle, options, max_tokens
        #: how the model is named to the user: as given (a store or registered name as it
        #: is, not the store's folder), else its folder
        self.name = name or str(bundle.path)
        self.think, self.verbose, self.color = think, verbose, color
        self.write, self.conversations = write, conversations
        self.stops: list[str] = bundle.stop_strings()
        self.parameters: dict[str, Any] = {}  # what /set parameter changed, for /save
        self.messages: list[dict[str, Any]] = \
            [{"role": "system", "content": system}] if system else []
        self._explained = False
        self.prefix_cache = prefix_cache_for(bundle.model.make_cache, weights_bytes(bundle.model))
        #: media for the next message (/image, /audio, or image paths in it) as (modality,
        #: path), and every file read, by path
        self.pending: list[tuple[str, str]] = []
        self._read: dict[str, Any] = {}

    # -- the conversation ------------------------------------------------------
    @property
    def system(self) -> str | None:
        if self.messages and self.messages[0]["role"] == "system":
            return str(self.messages[0]["content"])
        return None

    def set_system(self, text: str) -> None:
        if self.system is not None:
            self.messages = self.messages[1:]
        if text:
            self.messages.insert(0, {"role": "system", "content": text})

    def clear(self) -> None:
        system = self.system
        self.messages = []
        self.pending = []
        self.set_system(system or "")

    def attach(self, path: str, modality: str = "image") -> bool:
        """Read an image or audio file for the next message (the core's limits); False,
        said, where it cannot be read."""
        full = str(Path(path).expanduser().resolve())
        try:
            self._media(modality, full)
        except MediaError as exc:
            self.say(str(exc).splitlines()[0])
            return False
        self.pending.append((modality, full))
        self.say(f"Added {modality} '{path}'")
        return True

    def _media(self, modality: str, path: str) -> Any:
        """An image's pixels, or an audio file's bytes (decoded at its encoder's rate by
        :meth:`mlxrunner.Bundle.place_media`), read once per file."""
        key = f"{modality}:{path}"
        if key not in self._read:
            self._read[key] = read_image(path) if modality == "image" else \
                read_media_file(path, MAX_AUDIO_BYTES, "audio")
        return self._read[key]

    def _takes_images(self) -> bool:
        try:
            return "image" in self.bundle.encoders()
        except MLXRunnerError:
            return False

    def send(self, text: str) -> None:
        """One turn: the message (with the images attached to it), the reply streamed,
        both kept."""
        bundle = self.bundle
        for path, found in image_paths(text) if self._takes_images() else ():
            if self.attach(path):
                text = re.sub(r"[ \t]{2,}", " ", text.replace(found, " ", 1)).strip()
        attached, self.pending = self.pending, []
        content: Any = text if not attached else [
            *({"type": modality, "data": path} for modality, path in attached),
            {"type": "text", "text": text}]
        self.messages.append({"role": "user", "content": content})
        with plugin_code("renderers", bundle.renderer_name):
            prompt = bundle.renderer.render(self.messages, None, think=self.think,
                                            add_generation_prompt=True)
        try:
            media = self._media_of(self.messages)  # (a loaded conversation's file may be gone)
            reply = stream_reply(bundle, prompt, self.options, self.max_tokens,
                                 bundle.stop_token_ids(), self.write, self.color,
                                 stops=self.stops, prefix_cache=self.prefix_cache, media=media)
        except KeyboardInterrupt:
            self.messages.pop()
            self.write("\n(reply abandoned; the conversation is as before it)\n")
            return
        except MediaError as exc:
            self.messages.pop()
            self.say(f"{str(exc).splitlines()[0]} (the message was not sent)")
            return
        self.messages.append(reply.message.to_message())
        if self.verbose:
            self._statistics(reply.stats)

    def _media_of(self, messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
        """The conversation's images' pixels and clips' samples (their parts hold paths), in
        render order."""
        return [(modality, self._media(modality, str(part["data"])))
                for modality, part in media_parts(messages)]

    def _statistics(self, stats: dict[str, Any]) -> None:
        lines = describe_run(stats, explain=not self._explained)
        self._explained = True
        text = "\n".join(lines) + "\n"
        self.write(f"{DIM}{text}{RESET}" if self.color else text)

    # -- commands --------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run one ``/`` command; False when it ends the chat."""
        words = line.split()
        name, args = words[0], words[1:]
        if name in ("/bye", "/exit"):
            return False
        if name in ("/?", "/help"):
            topic = args[0] if args else ""
            self.say({"set": SET_HELP, "show": SHOW_HELP, "shortcuts": SHORTCUTS,
                      "shortcut": SHORTCUTS}.get(topic, COMMANDS))
        elif name in ("/image", "/audio"):
            if len(args) != 1:
                self.say(f"Usage: {name} PATH")
            else:
                self.attach(args[0], name[1:])
        elif name == "/clear":
            self.clear()
            self.say("Cleared session context.")
        elif name == "/set":
            self._set(line, args)
        elif name == "/show":
            self._show(args[0] if args else "")
        elif name in ("/save", "/load"):
            if len(args) != 1:
                self.say(f"Usage: {name} NAME")
            else:
                self._save(args[0]) if name == "/save" else self._load(args[0])
        else:
            self.say(f"Unknown command '{name}'. Type /? for help")
        return True

    def say(self, text: str) -> None:
        self.write(text + "\n")

    def _set(self, line: str, args: list[str]) -> None:
        what = args[0] if args else ""
        if what == "parameter":
            self._set_parameter(args[1:])
        elif what == "system":
            text = line.split(None, 2)[2] if len(args) > 1 else ""
            self.set_system(text.strip())
            self.say("Set system message." if text.strip() else "Cleared system message.")
        elif what in ("think", "nothink"):
            self.think = what == "think"
            self.say(f"Set '{what}' mode.")
        elif what in ("verbose", "quiet"):
            self.verbose = what == "verbose"
            self.say(f"Set '{what}' mode.")
        else:
            self.say(SET_HELP)

    def _set_parameter(self, args: list[str]) -> None:
        names = [f.name for f in fields(SamplerOptions)] + list(EXTRA_PARAMETERS)
        if len(args) < 2:
            self.say("Usage: /set parameter NAME VALUE; NAME one of:")
            for name in names:
                self.say(f"  {name:18} {OPTION_HELP.get(name) or EXTRA_PARAMETERS[name]}")
            return
        name, values = args[0], args[1:]
        if name == "stop":
            self.stops = values
            self.parameters["stop"] = values
        elif name == "num_predict":
            try:
                count = int(values[0])
            except ValueError:
                count = 0
            if count < 1:
                self.say(f"Couldn't set parameter: num_predict must be a whole number >= 1, "
                         f"got {values[0]!r}")
                return
            self.max_tokens = count
        elif name in names and len(values) == 1:
            try:
                self.options = self.options.merged({name: _number(values[0])})
            except SamplerOptionError as exc:
                self.say(f"Couldn't set parameter: {exc}")
                return
            self.parameters[name] = getattr(self.options, name)
        else:
            self.say(f"Couldn't set parameter: unknown parameter {name!r} (/set parameter "
                     "lists them)" if name not in names else
                     f"Couldn't set parameter: {name} takes one value")
            return
        self.say(f"Set parameter '{name}' to '{' '.join(values)}'")

    def _show(self, what: str) -> None:
        bundle = self.bundle
        if what == "info":
            arch = (bundle.config.get("architectures") or [bundle.config.get("model_type")])[0]
            context = bundle.extra.get("context")
            count = getattr(context, "num_parameters", None)
            draft = type(bundle.draft).__name__ if bundle.draft is not None else "none"
            turns = sum(1 for m in self.messages if m["role"] == "user")
            rows = [("model", self.name), ("architecture", arch),
                    ("parameters", f"{count:,}" if count else "-"), ("draft", draft),
                    ("renderer", bundle.renderer_name or "-"),
                    ("parser", bundle.parser_name or "-"),
                    ("conversation", f"{len(self.messages)} messages, {turns} from you")]
            self.say("\n".join(f"  {key:14} {value}" for key, value in rows))
        elif what == "parameters":
            rows = [(f.name, getattr(self.options, f.name)) for f in fields(SamplerOptions)]
            rows += [("num_predict", self.max_tokens),
                     ("stop", " ".join(json.dumps(s) for s in self.stops) or "-")]
            self.say("\n".join(f"  {key:18} {value}" for key, value in rows))
        elif what == "system":
            self.say(self.system if self.system is not None else
                     "No system message was specified for this model.")
        elif what == "template":
            template = getattr(bundle.tokenizer, "chat_template", None)
            self.say(template if template else
                     f"No template: the renderer {bundle.renderer_name!r} builds the prompt.")
        elif what == "modelfile":
            path = getattr(bundle.modelfile, "path", None)
            try:
                self.say(Path(path).read_text(encoding="utf-8").rstrip() if path else
                         f"No Modelfile in {bundle.path}.")
            except OSError as exc:
                self.say(f"{path}: cannot read ({exc.strerror or exc})")
        else:
            self.say(SHOW_HELP)

    def _save(self, name: str) -> None:
        if self.conversations is None:
            self.say("Saving is off in this chat.")
            return
        try:
            path = conversation_file(self.conversations, name)
            save_conversation(path, SavedConversation(
                model=self.name, messages=self.messages,
                parameters=dict(self.parameters), num_predict=self.max_tokens,
                think=self.think))
        except MLXRunnerError as exc:
            self.say(f"Couldn't save: {exc}")
            return
        self.say(f"Saved conversation '{name}' ({len(self.messages)} messages) to {path}")

    def _load(self, name: str) -> None:
        if self.conversations is None:
            self.say("Loading is off in this chat.")
            return
        try:
            saved = load_conversation(conversation_file(self.conversations, name))
            stops = saved.parameters.get("stop")
            options = self.bundle.defaults.merged(
                {k: v for k, v in saved.parameters.items() if k != "stop"})
        except (MLXRunnerError, TypeError) as exc:
            self.say(f"Couldn't load: {exc}")
            return
        self.messages = [dict(m) for m in saved.messages]
        self.options, self.parameters = options, dict(saved.parameters)
        self.stops = list(stops) if isinstance(stops, list) else self.bundle.stop_strings()
        self.max_tokens = saved.num_predict or self.max_tokens
        self.think = saved.think
        note = "" if saved.model in (self.name, str(self.bundle.path)) else \
            f"; it was saved with {saved.model}, replies now come from this model"
        self.say(f"Loaded conversation '{name}' ({len(self.messages)} messages){note}")


#: a path to an image file in a message, bare or quoted (as ``ollama run`` finds them)
_IMAGE_PATH = re.compile(r"""(?:'([^']+\.(?:png|jpe?g|webp|gif|bmp))'|"([^"]+\.(?:png|jpe?g|webp"""
                         r"""|gif|bmp))"|((?:~|\.{1,2}|/)?[^\s'"]*\.(?:png|jpe?g|webp|gif|bmp))"""
                         r"""(?!\w))""", re.IGNORECASE)


def image_paths(text: str) -> list[tuple[str, str]]:
    """The image files a message names that exist: ``(path, as written)`` pairs."""
    found = []
    for match in _IMAGE_PATH.finditer(text):
        path = next(g for g in match.groups() if g)
        if Path(path).expanduser().is_file():
            found.append((path, match.group(0)))
    return found


def _number(text: str) -> Any:
    """A ``/set parameter`` value as typed: an int, a float, or the text itself."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_message(read: Callable[[str], str]) -> str:
    """The next message or command: one line, or the lines between ``\"\"\"`` marks
    (joined by newlines, without the marks; ``/set system \"\"\"`` opens them too, for a
    system message of several lines). EOFError and KeyboardInterrupt pass through."""
    return _read_input(read)[0]


def _read_input(read: Callable[[str], str]) -> tuple[str, bool]:
    """:func:`read_message`'s text, and whether it is a command (a line starting with ``/``,
    never text between quotes but for ``/set system``'s)."""
    line = read(PROMPT)
    opened = line.lstrip()
    command = ""
    if opened.startswith(SET_SYSTEM) and opened[len(SET_SYSTEM):].lstrip().startswith(QUOTES):
        command, opened = SET_SYSTEM + " ", opened[len(SET_SYSTEM):].lstrip()
    if not opened.startswith(QUOTES):
        return line, opened.startswith("/")
    rest = opened[len(QUOTES):]
    if rest.rstrip().endswith(QUOTES):
        return command + rest.rstrip()[:-len(QUOTES)], bool(command)
    lines = [rest] if rest.strip() else []
    while True:
        more = read(CONTINUATION)
        closed = more.rstrip()
        if closed.endswith(QUOTES):
            if closed[:-len(QUOTES)]:
                lines.append(closed[:-len(QUOTES)])
            return command + "\n".join(lines), bool(command)
        lines.append(more)


def chat_loop(bundle: Any, options: Any, *, max_tokens: int, think: bool | None = None,
              system: str | None = None, read: Callable[[str], str] = input,
              write: Callable[[str], Any] | None = None, color: bool = False,
              verbose: bool = False, conversations: Path | None = None,
              name: str | None = None) -> list[dict]:
    """Run the chat until ``/bye`` or end of input; returns the conversation.

    ``conversations`` is the folder ``/save`` and ``/load`` use (None: they are off);
    ``name`` what the user called the model (None: its folder)."""
    write = write or streamed.write
    if bundle.renderer is None:
        raise MLXRunnerError(f"{bundle.path}: no chat format to chat with (pass a prompt, "
                             "or --renderer NAME)")
    session = ChatSession(bundle, options, max_tokens=max_tokens, think=think, system=system,
                          write=write, color=color, verbose=verbose,
                          conversations=conversations, name=name)
    write(HELP + "\n")
    while True:
        try:
            text, is_command = _read_input(read)
        except EOFError:
            write("\n")
            break
        except KeyboardInterrupt:
            write("\n" + EXIT_HINT + "\n")
            continue
        if is_command:
            if not session.command(text.strip()):
                break
            continue
        if not text.strip():
            continue
        session.send(text)
    return session.messages


def stream_reply(bundle: Any, prompt: str, options: Any, max_tokens: int,
                 stop_ids: frozenset[int], write: Callable[[str], Any],
                 color: bool, *, stops: list[str] | None = None,
                 prefix_cache: Any = None, media: Sequence[tuple[str, Any]] = ()) -> Reply:
    """Decode one reply to the rendered ``prompt``, writing it as it comes; returns it parsed
    with its statistics. Ctrl-C ends it early (see the module's text). ``prefix_cache``: the
    conversation's (:class:`mlxrunner.cache.PrefixCache`), or None; ``media``: the images
    the prompt's placeholders stand for, in order (:meth:`mlxrunner.Bundle.place_media`)."""
    ids = bundle.place_media(bundle.tokenizer.encode(prompt, add_special_tokens=False), media)
    parser, tok = bundle.parser, bundle.tokenizer
    reply = ParsedMessage()
    in_thinking = False

    def show(pieces: list[ParsedMessage]) -> None:
        nonlocal in_thinking
        for piece in pieces:
            reply.add(piece)
            if piece.tool_calls:
                for call in piece.tool_calls:
                    write(json.dumps({"tool_call": {"name": call.name,
                                                    "arguments": call.arguments}},
                                     ensure_ascii=False) + "\n")
                continue
            thinking = bool(piece.thinking)
            if color and thinking != in_thinking:
                write(DIM if thinking else RESET)
            in_thinking = thinking
            write(piece.thinking or piece.content)

    def parsed(call: Callable[..., Any], *args: Any) -> Any:
        with plugin_code("parsers", bundle.parser_name):
            return call(*args)

    def feed(chunk: str) -> None:
        show(parsed(parser.feed, chunk) if parser is not None else
             [ParsedMessage(content=chunk)])

    text = TextStream(tok, stop_ids, bundle.stop_strings() if stops is None else stops,
                      on_text=feed)
    if parser is not None:
        parsed(parser.reset, prompt)
    with _ReplyInterrupt() as interrupt:
        result = generate(bundle.model, ids, options=options, max_tokens=max_tokens,
                          eos_ids=stop_ids, draft=bundle.draft, prefix_cache=prefix_cache,
                          on_token=lambda token: text.add(token) or interrupt.requested)
    text.finish()
    if parser is not None:
        show(parsed(parser.finish))
    if color and in_thinking:
        write(RESET)
    write("\n")
    if result.finish_reason == "length" and not interrupt.requested:
        notice = f"(the reply reached the {max_tokens}-token cap; /set parameter num_predict N)"
        write(f"{DIM}{notice}{RESET}\n" if color else notice + "\n")
    return Reply(reply, result.stats.as_dict(), interrupt.requested)
