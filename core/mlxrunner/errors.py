"""Errors that reach the user as one line.

Every failure a user can cause (a broken model folder, an unknown name, a bad
Modelfile) raises a subclass of :class:`MLXRunnerError`; the CLI prints its
message on one line and exits non-zero. Anything else is a bug and keeps its
traceback (with ``--debug``).
"""

from __future__ import annotations


class MLXRunnerError(Exception):
    """A problem with the user's input, reported as one clear line."""


class ModelFolderError(MLXRunnerError):
    """The model folder is missing, incomplete or corrupt."""


class UnknownNameError(MLXRunnerError):
    """An architecture, renderer, parser, draft or model name nobody registered."""


class PluginError(MLXRunnerError):
    """Plugins conflict (a name already taken) or misbehave."""


class PluginFailedError(PluginError):
    """A plugin's code (a renderer, a parser) raised while it ran: the message names what
    failed and the plugin behind it; the original exception is its ``__cause__``."""


class ModelfileError(MLXRunnerError):
    """A Modelfile line could not be read."""


class TemplateError(MLXRunnerError):
    """A chat template ran past its time limit, built a value or an output above its size
    limit, or nested its macros too deeply."""


class TokenizerInputError(MLXRunnerError):
    """A text the tokenizer refuses: too long, or one its Rust code panicked on."""


class PromptError(MLXRunnerError, ValueError):
    """A prompt the model cannot take: empty, or holding a token id outside its vocabulary
    (a tokenizer that is not the model's)."""


class ConversationError(MLXRunnerError):
    """A malformed conversation (messages, tools) handed to a renderer."""


class DraftConfigError(MLXRunnerError):
    """A draft's config does not fit its target."""


class MediaError(MLXRunnerError):
    """An image (or other media) that cannot be used: not an image, corrupt or truncated, in
    a format not accepted, larger than its byte or pixel limit, or Pillow missing."""
