"""uvicorn's httptools protocol with OpenAI-shaped errors for requests that are not valid HTTP, and a bound
on a request's head.

A request the HTTP parser rejects (a bad Content-Length, a malformed request line or header) never
reaches the ASGI app; uvicorn answers it from the protocol itself with a plain-text 400. This subclass
writes the same 400 with a JSON error body. (Without httptools, uvicorn's h11 protocol, still plain text,
serves instead; it bounds heads itself.)

httptools bounds nothing before the body (the body cap is the app's, guard.py): a header of 128 MiB was read
whole, at a cost that grows with its square on the event loop (20 s of CPU, every stream stalled), and memory
the server kept. A head (request line and headers) past MAX_HEAD_BYTES is a 431 and the connection closes."""
from __future__ import annotations

import msgspec

from tokenmill.entrypoints.openai.errors import error_dict


MAX_HEAD_BYTES = 64 * 1024  # (nginx's default bound is 8 KiB a header line, Node's 16 KiB a head)


def http_protocol():
    """The protocol class to give uvicorn.Config(http=...), or "auto" without httptools."""
    try:
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
    except ImportError:
        return "auto"

    class JSONErrorHttpToolsProtocol(HttpToolsProtocol):
        head_bytes: int | None = 0  # bytes of the current request's head so far (None: reading its body)
        heads_done = 0

        def data_received(self, data: bytes) -> None:
            # the parser gets at most the bound's worth of an open head; if that does not close it, 431 (data
            # may hold more than one request: kept alive, pipelined)
            while self.head_bytes is not None and self.head_bytes + len(data) > MAX_HEAD_BYTES:
                room, done = MAX_HEAD_BYTES - self.head_bytes, self.heads_done
                self.head_bytes += room
                super().data_received(data[:room])
                data = data[room:]
                if self.transport.is_closing():
                    return
                if self.heads_done == done:
                    self._send_error(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")
                    return
            if self.head_bytes is not None:
                self.head_bytes += len(data)
            if data:
                super().data_received(data)

        def on_headers_complete(self) -> None:
            self.head_bytes = None
            self.heads_done += 1
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self.head_bytes = 0  # (keep-alive: the next request's head)
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            self._send_error(400, f"malformed HTTP request: {msg}")

        def _send_error(self, status: int, msg: str) -> None:
            if self.transport.is_closing():
                return
            body = msgspec.json.encode(error_dict(status, msg))
            head = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                head.extend([name, b": ", value, b"\r\n"])
            head.extend([b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                         b"connection: close\r\n", b"\r\n", body])
            self.transport.write(b"".join(head))
            self.transport.close()

    return JSONErrorHttpToolsProtocol
