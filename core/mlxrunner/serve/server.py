"""Running the app: a socket bound first (a taken port is reported before a long model load),
then uvicorn on it, in this thread (``mlxrunner serve``) or another (tests, notebooks)."""

from __future__ import annotations

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


class JSONErrorsH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a request it cannot parse (a garbage request line,
    an over-long header) answered in JSON like every other error, not plain text."""

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


class Listener:
    """uvicorn serving ``app`` on an already bound socket."""

    def __init__(self, app: Any, sock: socket.socket, *,
                 keep_alive_timeout: int = DEFAULT_KEEP_ALIVE) -> None:
        self.sock = sock
        config = uvicorn.Config(app, http=JSONErrorsH11Protocol, lifespan="off",
                                access_log=False, log_config=None,
                                timeout_keep_alive=keep_alive_timeout,
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
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
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sock.close()
