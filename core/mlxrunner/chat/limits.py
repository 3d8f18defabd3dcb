"""Limits on a chat template's render: a time limit and a size limit.

A template is untrusted code: ``range(10**5)`` nested in itself, a recursive macro or
``'x' * 10**10`` must end in one :class:`~mlxrunner.errors.TemplateError` line, quickly and
with bounded memory. Every step that can make a large value is checked before it runs
(``*``, ``**``, ``+``, ``%``, ``~``, the size arguments of filters and string methods,
``join`` and ``replace``) and every value a call or filter returns after it, against
:attr:`RenderLimits.max_chars`; the output is counted as it is produced. Those checks also
watch the clock; a loop that makes nothing is stopped by a watchdog that raises in the
rendering thread.
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jinja2.compiler
import jinja2.nodes
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment

_MAX_INT_BITS = 4096
_FORMAT_NUMBER = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\d*|\*)(?:\.(\d+|\*))?")
#: filters whose arguments are values, not widths or counts
_VALUE_FILTERS = frozenset({"format", "default", "d"})


class LimitExceeded(Exception):
    """A render went past one of its limits (the message says which)."""


class RenderTimedOut(BaseException):
    """Raised in the rendering thread by the watchdog; a BaseException so that no
    ``except Exception`` on the way swallows it. :class:`limited_render` turns it into
    :class:`LimitExceeded`, except where it lands in that turning itself."""


@dataclass(frozen=True)
class RenderLimits:
    seconds: float = 10.0
    #: characters of the output, of any string built, items of any list
    max_chars: int = 8 * 2**20
    max_macro_depth: int = 64


_DEFAULT = RenderLimits()


class _Render:
    """The state of one render: its deadline, macro depth and the sizes of the containers
    it has seen (each object kept, so that its id names it)."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.depth = 0
        self.sizes: dict[int, tuple[int, Any]] = {}

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise LimitExceeded(f"ran longer than {self.limits.seconds:g} s")


_current: contextvars.ContextVar[_Render | None] = contextvars.ContextVar(
    "mlxrunner_template_render", default=None)


def _limits() -> RenderLimits:
    render = _current.get()
    return render.limits if render is not None else _DEFAULT


def _tick() -> None:
    render = _current.get()
    if render is not None:
        render.check_time()


_CONTAINERS = (list, tuple, dict, set, frozenset)
_MAX_NESTING = 256


def _size(value: Any, depth: int = 0) -> int:
    """What printing a value would make: the characters of its strings and one per item,
    through every level (``[x, x]`` nested 40 times is 2**40 large, however little memory
    its shared items take). Each container is sized once per render."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, _CONTAINERS):
        return 1
    render = _current.get()
    if render is not None:
        known = render.sizes.get(id(value))
        if known is not None and known[1] is value:
            return known[0]
    if depth > _MAX_NESTING:
        raise LimitExceeded(f"went past its nesting limit of {_MAX_NESTING} levels")
    items: Iterable[Any] = (*value.keys(), *value.values()) if isinstance(value, dict) else value
    limit = _limits().max_chars
    total = len(value)
    for item in items:
        total += _size(item, depth + 1)
        if total > limit:
            break  # past the limit already: the caller reports it
    if render is not None:
        render.sizes[id(value)] = (total, value)
    return total


def _printed_size(value: Any) -> int:
    """About the length of ``str(value)``."""
    if isinstance(value, (str, *_CONTAINERS)):
        return _size(value)
    return len(str(value))


def check_size(size: int, what: str = "a value") -> None:
    limit = _limits().max_chars
    if size > limit:
        raise LimitExceeded(f"went past its size limit of {limit} ({what} of {size})")


def _check_value(value: Any) -> Any:
    check_size(_size(value))
    if isinstance(value, int) and not isinstance(value, bool):
        _check_int_bits(value.bit_length())
    return value


def _check_int_bits(bits: int) -> None:
    if bits > _MAX_INT_BITS:
        raise LimitExceeded(f"went past its size limit of {_MAX_INT_BITS} bits for a number "
                            f"({bits} bits)")


def _check_count(value: Any) -> None:
    """A width, count or repetition argument: no larger than the size limit."""
    if isinstance(value, int) and not isinstance(value, bool):
        check_size(abs(value), "a width or count")


def _check_format_numbers(spec: str) -> None:
    for number in _FORMAT_NUMBER.findall(spec):
        check_size(int(number) if len(number) < 20 else 10**20, "a format width")


def _check_percent(template: str, args: Any) -> None:
    starred = False
    for width, precision in _PERCENT_SPEC.findall(template):
        for number in (width, precision):
            starred |= number == "*"
            if number.isdigit():
                _check_format_numbers(number)
    if starred:  # widths taken from the arguments
        for arg in args if isinstance(args, tuple) else (args,):
            _check_count(arg)


def _repeat(sequence: Any, times: Any) -> None:
    if isinstance(times, int) and not isinstance(times, bool):
        check_size(_size(sequence) * max(times, 0))


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        _repeat(left, right)
        _repeat(right, left)
        if all(isinstance(x, int) for x in (left, right)):
            _check_int_bits(left.bit_length() + right.bit_length())
    elif operator == "**":
        if (isinstance(left, int) and isinstance(right, int) and right > 0
                and abs(left) > 1):
            _check_int_bits(right * left.bit_length())
    elif operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            check_size(_size(left) + _size(right))
    elif operator == "%" and isinstance(left, str):
        _check_percent(left, right)
        check_size(len(left) + _size(right))


def _joined_size(items: Any, separator: Any) -> int:
    items = list(items)
    check_size(len(items), "a list")
    return (sum(_printed_size(item) for item in items)
            + len(str(separator)) * max(len(items) - 1, 0))


def _replaced_size(text: Any, old: Any, new: Any, count: Any = None) -> int:
    text, old, new = str(text), str(old), str(new)
    found = text.count(old)
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(text) + found * max(len(new) - len(old), 0)


def _indented_size(text: Any, width: Any = 4, *_: Any, **__: Any) -> int:
    text = str(text)
    pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    return len(text) + (text.count("\n") + 1) * max(pad, 0)


def _wrapped_size(text: Any, width: Any = 79, break_long_words: Any = True,
                  wrapstring: Any = None, *_: Any, **__: Any) -> int:
    text = str(text)
    lines = len(text) // max(width, 1) + 1 if isinstance(width, int) else len(text) + 1
    return len(text) + lines * len(str(wrapstring or "\n"))


#: the output size of the filters that can make more than their arguments hold
_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "join": lambda value, d="", attribute=None: _joined_size(value, d),
    "replace": _replaced_size,
    "indent": _indented_size,
    "wordwrap": _wrapped_size,
}


def _checked_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(function, "_mlxrunner_checked", False):
        return function
    passes_context = hasattr(function, "jinja_pass_arg")
    size_of = _FILTER_SIZES.get(name)
    counts_checked = name not in _VALUE_FILTERS

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        _tick()
        own = args[1:] if passes_context else args
        if own:  # what tojson, string, pprint ... print
            check_size(_size(own[0]))
        if counts_checked:
            for arg in (*own[1:], *kwargs.values()):
                _check_count(arg)
        if name == "format" and own:
            _check_percent(str(own[0]), tuple(own[1:]))
        if size_of is not None and own:
            if name == "join" and not isinstance(own[0], (list, tuple)):
                own = (list(own[0]), *own[1:])  # sized once, then joined
                args = (args[0], *own) if passes_context else own
            check_size(size_of(*own, **kwargs))
        return _check_value(function(*args, **kwargs))

    checked._mlxrunner_checked = True  # type: ignore[attr-defined]
    return checked


class _CheckedFilters(dict):
    """An environment's filters, each one checked (also those set after it is made)."""

    def __setitem__(self, name: str, function: Callable[..., Any]) -> None:
        super().__setitem__(name, _checked_filter(name, function))


def _checked_method_args(method: Any, args: tuple, kwargs: dict) -> tuple:
    """The arguments of a string method, checked (an iterable to join made a list)."""
    owner = getattr(method, "__self__", None)
    if not isinstance(owner, str):
        return args
    for arg in (*args, *kwargs.values()):
        _check_count(arg)
        check_size(_size(arg))
    name = getattr(method, "__name__", "")
    if name == "join" and args:
        items = args[0] if isinstance(args[0], (list, tuple)) else list(args[0])
        check_size(_joined_size(items, owner))
        return (items, *args[1:])
    if name == "replace" and len(args) >= 2:
        check_size(_replaced_size(owner, *args[:3]))
    return args


class _CheckedCodeGenerator(jinja2.compiler.CodeGenerator):
    """Compiles ``~`` and list, tuple and dict literals through the environment, so that
    each is sized as it is made."""

    def _checked(self, visit: Callable[..., None], node: Any, frame: Any) -> None:
        if getattr(node, "ctx", "load") != "load":  # an assignment target
            visit(node, frame)
            return
        self.write("environment.checked_value(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: jinja2.nodes.List, frame: jinja2.compiler.Frame) -> None:
        self._checked(super().visit_List, node, frame)

    def visit_Tuple(self, node: jinja2.nodes.Tuple, frame: jinja2.compiler.Frame) -> None:
        self._checked(super().visit_Tuple, node, frame)

    def visit_Dict(self, node: jinja2.nodes.Dict, frame: jinja2.compiler.Frame) -> None:
        self._checked(super().visit_Dict, node, frame)

    @jinja2.compiler.optimizeconst
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with every amplifying step sized before it runs."""

    code_generator_class = _CheckedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        options.setdefault("finalize", _check_value)  # what {{ }} prints, before str()
        super().__init__(**options)
        filters = _CheckedFilters()
        for name, function in self.filters.items():
            filters[name] = function
        self.filters = filters

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any,
                   right: Any) -> Any:
        _tick()
        _check_binop(operator, left, right)
        return _check_value(super().call_binop(context, operator, left, right))

    def call(__self, __context: jinja2.runtime.Context, __obj: Any,  # noqa: N805
             *args: Any, **kwargs: Any) -> Any:
        render = _current.get()
        if render is not None:
            render.check_time()
        args = _checked_method_args(__obj, args, kwargs)
        if isinstance(__obj, jinja2.runtime.Macro) and render is not None:
            render.depth += 1
            try:
                if render.depth > render.limits.max_macro_depth:
                    raise LimitExceeded(f"nested its macros deeper than "
                                        f"{render.limits.max_macro_depth}")
                result = super().call(__context, __obj, *args, **kwargs)
            finally:
                render.depth -= 1
        else:
            result = super().call(__context, __obj, *args, **kwargs)
        return _check_value(result)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        template = str(getattr(value, "__self__", ""))

        def checked(*args: Any, **kwargs: Any) -> str:
            for _, _, spec, _ in _formatter_fields(template):
                _check_format_numbers(spec)
            check_size(len(template) + sum(_printed_size(a) for a in (*args, *kwargs.values())))
            return _check_value(wrapped(*args, **kwargs))

        return checked

    @staticmethod
    def checked_value(value: Any) -> Any:
        _tick()
        return _check_value(value)

    @staticmethod
    def checked_concat(values: tuple) -> str:
        _tick()
        check_size(sum(_printed_size(v) for v in values))
        pieces = [str(v) for v in values]
        check_size(sum(len(p) for p in pieces))
        return "".join(pieces)


def _formatter_fields(template: str) -> Iterator[tuple[str, str | None, str, str | None]]:
    import string

    try:
        for literal, field, spec, conversion in string.Formatter().parse(template):
            yield literal, field, spec or "", conversion
    except ValueError:
        return  # str.format reports the malformed string itself


def _raise_in(thread_id: int, exception: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exception) if exception else None)


class limited_render:  # noqa: N801  (used as a function: ``with limited_render(...)``)
    """Run a render under ``limits``: checks raise :class:`LimitExceeded`; a little past
    the deadline a watchdog raises :class:`RenderTimedOut` in this thread (Python code that
    makes nothing, such as nested loops with empty bodies, passes no check)."""

    _GRACE_S = 0.25

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._active = False
        self._fired = False

    def _fire(self) -> None:
        with self._lock:
            if self._active:
                self._fired = True
                _raise_in(self._thread_id, RenderTimedOut)

    def __enter__(self) -> limited_render:
        self._token = _current.set(_Render(self.limits))
        self._thread_id = threading.get_ident()
        self._active = True
        self._watchdog = threading.Timer(self.limits.seconds + self._GRACE_S, self._fire)
        self._watchdog.daemon = True
        self._watchdog.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: Any) -> None:
        try:
            self._watchdog.cancel()
            with self._lock:
                self._active = False
                if self._fired:
                    _raise_in(self._thread_id, None)  # not delivered yet: take it back
        finally:
            _current.reset(self._token)
        if kind is not None and issubclass(kind, RenderTimedOut):
            raise LimitExceeded(f"ran longer than {self.limits.seconds:g} s") from None
