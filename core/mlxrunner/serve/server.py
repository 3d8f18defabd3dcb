"""Running the app: a socket bound first (a taken port is reported before a long model load),
then uvicorn on it, in this thread (``mlxrunner serve``) or another (tests, notebooks)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import MAX_HEADER_BYTES
from .errors import OPENAI, error_bytes

log = logging.getLogger("mlxrunner.serve")
#: seconds an idle keep-alive connection stays open (``--keep-alive-timeout``)
DEFAULT_KEEP_ALIVE = 5
#: seconds a request's headers and body may take to arrive once its first byte has (a
#: client sending them slowly holds a connection, and enough of them every file the
#: process may open)
REQUEST_READ_TIMEOUT = 30.0
#: connections (and requests in flight) at once; past it, 503 at once (macOS lets a
#: process open 256 files by default)
MAX_CONNECTIONS = 200


class JSONErrorsH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a request it cannot parse (a garbage request line,
    an over-long header) answered in JSON like every other error, not plain text."""

    read_timeout = REQUEST_READ_TIMEOUT
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # a connection that sends nothing holds a place too (past MAX_CONNECTIONS, every
        # request is a 503)
        self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self.conn.their_state is not h11.DONE:
            self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.SEND_BODY and \
                self.conn.their_state is not h11.IDLE:  # the whole request is in
            self._stop_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_read_timer()
        super().connection_lost(exc)

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        """The request did not arrive whole in time: 408 where nothing was answered yet,
        and the connection is closed."""
        self._read_timer = None
        if self.transport.is_closing():
            return
        log.info("mlxrunner: a request took longer than %g s to arrive: connection closed",
                 self.read_timeout)
        if self.cycle is None or not self.cycle.response_started:
            body = error_bytes(OPENAI, 408, f"the request did not arrive within "
                                            f"{self.read_timeout:g} s")
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: " + str(len(body)).encode()
                + b"\r\n\r\n" + body)
        if self.cycle is not None:
            self.cycle.disconnected = True
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        body = error_bytes(OPENAI, 400, f"invalid HTTP request ({msg})")
        event = h11.Response(status_code=400, reason=b"Bad Request", headers=[
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")])
        for part in (event, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(part) or b"")
        self.transport.close()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free one); OSError when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)  # the standard library's 5 reset clients under load
    except BaseException:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app's engines when it starts to stop (Ctrl-C): their
    open replies end with an error event at once, so the graceful shutdown finds no
    response left to cancel mid-stream."""

    def __init__(self, config: uvicorn.Config, on_exit: Any) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            # not in the signal handler: it runs on the event loop's thread between two
            # bytecodes, maybe inside a section that holds an engine's lock
            threading.Thread(target=self._on_exit, name="mlxrunner-shutdown",
                             daemon=True).start()
        super().handle_exit(sig, frame)


def _shut_down_engines(app: Any) -> None:
    models = getattr(getattr(app, "state", None), "models", None)
    if models is None:
        return
    try:
        services = [service for service, _ in models.loaded()]
    except Exception:  # stopping must go on whatever the models' state
        log.exception("mlxrunner: could not reach the loaded models to stop them")
        return
    for service in services:
        service.engine.shut_down()


class Listener:
    """uvicorn serving ``app`` on an already bound socket."""

    def __init__(self, app: Any, sock: socket.socket, *,
                 keep_alive_timeout: int = DEFAULT_KEEP_ALIVE,
                 read_timeout: float = REQUEST_READ_TIMEOUT) -> None:
        self.sock = sock
        protocol = type("Protocol", (JSONErrorsH11Protocol,), {"read_timeout": read_timeout})
        config = uvicorn.Config(app, http=protocol, lifespan="off",
                                access_log=False, log_config=None,
                                timeout_keep_alive=keep_alive_timeout,
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                                timeout_graceful_shutdown=5,
                                limit_concurrency=MAX_CONNECTIONS)
        self.server = _Server(config, lambda: _shut_down_engines(app))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve(self) -> None:
        """Serve until interrupted (Ctrl-C)."""
        self.server.run(sockets=[self.sock])

    def start(self) -> Listener:
        """Serve on a thread of its own; returns once it accepts connections."""
        self._thread = threading.Thread(target=self.serve, name="mlxrunner-http", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread ended before it started serving")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving (the engines, which other listeners may share, keep running)."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sock.close()
