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


def validation_message(errors: list[dict], union_tags=frozenset()) -> tuple[str, str | None]:
    """A 400's message and `param` from pydantic's errors: the first error, located as `prompt[0]` or
    `messages[0].content` (the body prefix and the tags of union branches dropped)."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    loc = [x for x in e.get("loc", ()) if x != "body" and x not in union_tags]
    where = ""
    for x in loc:
        where += f"[{x}]" if isinstance(x, int) else (f".{x}" if where else str(x))
    param = next((x for x in loc if isinstance(x, str)), None)
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"invalid value for '{where or 'body'}': {e.get('msg')}{more}", param


def _encodable(text):
    """Error text can quote what a client sent; nothing it holds may stop the error from being encoded."""
    if isinstance(text, str) and not text.isascii():
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def error_dict(status: int, message: str, param: str | None = None, code=None) -> dict:
    message, param = _encodable(message), _encodable(param)
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None, code=None,
                   headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(error_dict(status, message, param, code)), status_code=status,
                    media_type="application/json", headers=headers)
