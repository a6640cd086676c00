"""uvicorn's httptools protocol with OpenAI-shaped errors for requests that are not valid HTTP.

A request the HTTP parser rejects (a bad Content-Length, a malformed request line or header) never
reaches the ASGI app; uvicorn answers it from the protocol itself with a plain-text 400. This subclass
writes the same 400 with a JSON error body. (Without httptools, uvicorn's h11 protocol, still plain text,
serves instead.)"""
from __future__ import annotations

import msgspec

from tokenmill.entrypoints.openai.errors import error_dict


def http_protocol():
    """The protocol class to give uvicorn.Config(http=...), or "auto" without httptools."""
    try:
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
    except ImportError:
        return "auto"

    class JSONErrorHttpToolsProtocol(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            body = msgspec.json.encode(error_dict(400, f"malformed HTTP request: {msg}"))
            head = [STATUS_LINE[400]]
            for name, value in self.server_state.default_headers:
                head.extend([name, b": ", value, b"\r\n"])
            head.extend([b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                         b"connection: close\r\n", b"\r\n", body])
            self.transport.write(b"".join(head))
            self.transport.close()

    return JSONErrorHttpToolsProtocol
