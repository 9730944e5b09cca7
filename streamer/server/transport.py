"""What uvicorn runs under `streamer serve`: an HTTP protocol that bounds connections, and
log filters that keep secrets out of the logs.

uvicorn (httptools_impl.py and h11_impl.py alike) arms its keep-alive timer only when a
response completes, and cancels it at every byte received. So a connection that never
sends a byte is never closed, nor one that sends its head a byte every few seconds
(slowloris): 20,100 such connections used up the process's files and new clients were
reset. Its limit_concurrency answers 503 only once a request head is complete, which
an idle connection never sends. GuardedHttp adds the two missing pieces:

  * a head timer: from the connection's opening, and from the end of each response, the
    next request head must be complete within timeout_idle_connection, or the connection
    is closed (bytes arriving do not reset it);
  * a connection cap: a connection beyond max_connections (HTTP and WebSocket together)
    is answered 503 at once and closed after a moment;
  * a head size cap: httptools keeps a head of any size (a 10 s head of one endless header
    line took 55 MB); past MAX_HEAD_BYTES the answer is 431 and the connection is closed.

The body's own time limit is guard.JsonBody's, which can still answer 408.
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024
"""A request line and headers beyond this are refused (nginx allows 32 KiB, h11 16 KiB)."""
REFUSAL_LINGER = 1.0
"""Seconds a refused connection stays open: its client gets to send its request and read
the 503 (closing at once, with its request unread, would reset the connection instead)."""


def _canned(status: bytes, message: bytes, code: bytes, extra: bytes = b"") -> bytes:
    """A whole response in OpenAI's error shape, written by the protocol itself (no app runs)."""
    kind = b"server_error" if status.startswith(b"5") else b"invalid_request_error"
    body = (b'{"error": {"message": "' + message + b'", "type": "' + kind + b'", "param": null, '
            b'"code": "' + code + b'"}}')
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n" + extra + b"connection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


BUSY = _canned(b"503 Service Unavailable", b"the server has too many open connections; retry later "
               b"(streamer serve --max-connections)", b"too_many_connections", b"retry-after: 1\r\n")
HEAD_TOO_LARGE = _canned(b"431 Request Header Fields Too Large", b"the request line and headers are larger "
                         b"than %d bytes" % MAX_HEAD_BYTES, b"head_too_large")


def default_max_connections() -> int:
    """2048, or fewer where the process may open fewer files: 256 stay for the model's
    files, the engine's sockets and the logs."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 2048 if soft == resource.RLIM_INFINITY else max(16, min(2048, soft - 256))


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head timer and the connection cap (see above).
    The limits are class attributes: guarded_http() makes the class of one server."""

    head_timeout: ClassVar[float] = 10.0
    max_connections: ClassVar[int] = 2048

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timer: asyncio.TimerHandle | None = None
        self.refused = False
        self.in_head = True  # the next bytes are a request head (not a body)
        self.head_bytes = 0
        self.heads = 0  # request heads completed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.refused = True
            self.connections.discard(self)  # (not counted: it holds no request)
            transport.write(BUSY)
            self.head_timer = self.loop.call_later(REFUSAL_LINGER, transport.close)
            return
        self.arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.refused:  # a refused connection's request is read and dropped
            return
        counting, heads = self.in_head, self.heads
        super().data_received(data)
        if counting and self.heads == heads:  # (a read that ends a head is not counted: at most one read more)
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                if self.cycle is None or self.cycle.response_complete:
                    self.transport.write(HEAD_TOO_LARGE)
                self.transport.close()

    def on_headers_complete(self) -> None:
        self.cancel_head_timer()
        self.in_head, self.head_bytes, self.heads = False, 0, self.heads + 1
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.in_head = True  # (a pipelined request's head may follow at once)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None:  # idle now, waiting for the next head
            self.arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_head_timer()
        super().connection_lost(exc)

    def arm_head_timer(self) -> None:
        self.cancel_head_timer()
        self.head_timer = self.loop.call_later(self.head_timeout, self.head_timed_out)

    def cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def head_timed_out(self) -> None:
        self.head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def guarded_http(head_timeout: float, max_connections: int) -> type[GuardedHttp]:
    return type("GuardedHttp", (GuardedHttp,), {"head_timeout": head_timeout, "max_connections": max_connections})


# ---- logs ----------------------------------------------------------------------------------

SECRET_QUERY = re.compile(r"\b(api_key|api-key|access_token|token)=[^&\s\"]*", re.IGNORECASE)


class RedactSecrets(logging.Filter):
    """Query values that are secrets become "***" in log records. uvicorn logs the path with
    its query string: the access log for HTTP, uvicorn.error for WebSocket handshakes, where
    the chat page sends ?api_key= (browsers cannot set headers on a WebSocket)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(SECRET_QUERY.sub(r"\1=***", a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = SECRET_QUERY.sub(r"\1=***", record.msg)
        return True


def redact_logs() -> None:
    """Install RedactSecrets on uvicorn's loggers (after uvicorn.Config configured logging)."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())
