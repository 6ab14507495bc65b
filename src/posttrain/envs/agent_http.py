"""A minimal HTTP/1.1 server on a unix socket, for the per-episode endpoint of a black-box agent.

Only what OpenAI-style clients (``httpx`` under the official ``openai`` package) send is understood: a request
line, headers, a body of ``Content-Length`` bytes, keep-alive. Anything else (chunked uploads, oversized heads or
bodies) is answered with an error and the connection is closed. It is an asyncio server so that the calls it
serves run on the same event loop as the policy (`posttrain.rollout.AsyncBatcher`) that samples them.

The handler is ``async handle(method, path, headers, body) -> (status, content_type, body_bytes)``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 << 10
MAX_BODY_BYTES = 16 << 20
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 411: "Length Required",
            413: "Payload Too Large", 500: "Internal Server Error"}

Handler = Callable[[str, str, dict[str, str], bytes], Awaitable[tuple[int, str, bytes]]]


def json_body(status: int, payload: Any) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(payload).encode()


def error_body(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None
               ) -> tuple[int, str, bytes]:
    """OpenAI's error shape, so the client raises its usual exception with our message."""
    return json_body(status, {"error": {"message": message, "type": kind, "param": None, "code": code}})


class UnixHTTPServer:
    """Serves `handler` on the unix socket `path` until `close`."""

    def __init__(self, path: str, handler: Handler):
        self.path = path
        self.handler = handler
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._connection, path=self.path)

    async def close(self) -> None:
        """Stop listening and end every connection. Connections are closed, not cancelled: asyncio's stream
        server logs a cancelled connection task as an error (Python 3.11)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()  # a handler waiting for the next request gets EOF and returns
        pending = [task for task in self._connections if not task.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=5.0)
            for task in late:  # a handler still inside the policy after 5 s: give up on it
                task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self._writers.add(writer)
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._connections.discard(task)
            self._writers.discard(writer)
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection is to be closed."""
        head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
        if not head:
            return False
        if len(head) > MAX_HEAD_BYTES:
            await _send(writer, error_body(413, "request head too large"), keep_alive=False)
            return False
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, _version = lines[0].split(" ", 2)
        except ValueError:
            await _send(writer, error_body(400, "malformed request line"), keep_alive=False)
            return False
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            await _send(writer, error_body(411, "chunked request bodies are not supported; send Content-Length"),
                        keep_alive=False)
            return False
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            await _send(writer, error_body(413, f"request body must be 0..{MAX_BODY_BYTES} bytes"), keep_alive=False)
            return False
        body = await reader.readexactly(length) if length else b""
        try:
            response = await self.handler(method.upper(), target.split("?", 1)[0], headers, body)
        except Exception as error:  # noqa: BLE001 - a bug of ours: the agent gets a 500, the episode notes it
            log.exception("agent endpoint handler failed")
            response = error_body(500, f"{type(error).__name__}: {error}", kind="server_error")
        keep_alive = headers.get("connection", "").lower() != "close"
        await _send(writer, response, keep_alive=keep_alive)
        return keep_alive


async def _send(writer: asyncio.StreamWriter, response: tuple[int, str, bytes], keep_alive: bool) -> None:
    status, content_type, body = response
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n")
    writer.write(head.encode("latin-1") + body)
    await writer.drain()
