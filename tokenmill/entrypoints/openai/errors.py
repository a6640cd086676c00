"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import re

import msgspec
from starlette.responses import Response

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_error", 503: "service_unavailable"}
_PARAM = re.compile(r"'([a-z_]+)'")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def bad_request(e: Exception | str, param: str | None = None) -> APIError:
    """A ValueError from the engine names its field in quotes ('top_p'); surface it as `param`."""
    msg = str(e)
    if param is None:
        m = _PARAM.search(msg)
        param = m.group(1) if m else None
    return APIError(400, msg, param)


def error_dict(status: int, message: str, param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None, code=None,
                   headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(error_dict(status, message, param, code)), status_code=status,
                    media_type="application/json", headers=headers)
