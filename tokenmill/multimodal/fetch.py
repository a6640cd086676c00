"""Bytes of an image_url / video_url: `data:` URIs always, http(s) only when the server allows it.

The fetch has one deadline for all of it (connect, headers, body): per-socket timeouts alone let a
server that trickles a byte a second hold a request forever. A timer shuts the socket down at the
deadline, which wakes whatever read is blocked, and the body is read in chunks against a byte cap.
"""
from __future__ import annotations

import base64
import binascii
import http.client
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

_CHUNK = 64 * 1024


def fetch_url(url: str, *, allow_remote: bool, timeout_s: float, max_bytes: int) -> bytes:
    if not isinstance(url, str):
        raise ValueError(f"url must be a string, got {type(url).__name__}")
    scheme = url.split(":", 1)[0].strip().lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_uri(url, max_bytes=max_bytes)
    if scheme not in ("http", "https"):
        raise ValueError(f"unsupported URL scheme {scheme or '(none)'!r}: use a data: URI or http(s)")
    if not allow_remote:
        raise ValueError("remote image/video URLs are off on this server (start it with --mm-allow-remote-urls); "
                         "send the media inline as a data: URI")
    return _http_get(url, timeout_s=timeout_s, max_bytes=max_bytes)


def decode_data_uri(uri: str, *, max_bytes: int | None = None) -> bytes:
    """`data:[<mediatype>][;base64],<data>` -> bytes (RFC 2397). Refused before decoding if too large."""
    if not isinstance(uri, str) or not uri[:5].lower() == "data:":
        raise ValueError("bad data URI: it must start with 'data:'")
    header, sep, payload = uri[5:].partition(",")
    if not sep:
        raise ValueError("bad data URI: no ',' between the media type and the data")
    is_base64 = header.lower().endswith(";base64")
    # base64 decodes to 3/4 of its length: refuse by size before allocating the decoded bytes
    approx = len(payload) * 3 // 4 if is_base64 else len(payload)
    if max_bytes is not None and approx > max_bytes:
        raise ValueError(f"data URI payload of about {approx} bytes exceeds the limit of {max_bytes} bytes")
    if not is_base64:
        return urllib.parse.unquote_to_bytes(payload)
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"bad data URI: invalid base64 ({e})") from None
    if not data:
        raise ValueError("bad data URI: empty payload")
    return data


class _Tracked:
    """A connection that records its socket, so the deadline timer can shut it down."""

    def __init__(self, *args, socks: list, **kwargs):
        super().__init__(*args, **kwargs)
        self._socks = socks

    def connect(self):
        super().connect()
        self._socks.append(self.sock)


class _TrackedHTTP(_Tracked, http.client.HTTPConnection):
    pass


class _TrackedHTTPS(_Tracked, http.client.HTTPSConnection):
    pass


class _Handler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    def __init__(self, socks: list):
        urllib.request.HTTPHandler.__init__(self)
        self._socks = socks
        self._ssl = ssl.create_default_context()

    def http_open(self, req):
        return self.do_open(lambda *a, **kw: _TrackedHTTP(*a, socks=self._socks, **kw), req)

    def https_open(self, req):
        return self.do_open(lambda *a, **kw: _TrackedHTTPS(*a, socks=self._socks, context=self._ssl, **kw), req)


class _RedirectHandler(urllib.request.HTTPRedirectHandler):
    # urllib would follow a redirect to ftp:; a fetch stays on http(s)
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise ValueError(f"refusing a redirect to a non-http(s) URL: {newurl}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _shutdown(socks: list, expired: threading.Event) -> None:
    expired.set()
    for s in list(socks):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _http_get(url: str, *, timeout_s: float, max_bytes: int) -> bytes:
    socks: list = []
    expired = threading.Event()
    timer = threading.Timer(timeout_s, _shutdown, args=(socks, expired))
    timer.daemon = True
    opener = urllib.request.build_opener(_Handler(socks), _RedirectHandler())
    req = urllib.request.Request(url, headers={"User-Agent": "tokenmill", "Accept": "image/*,video/*,*/*"})
    deadline = time.monotonic() + timeout_s
    timer.start()
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > max_bytes:
                raise ValueError(f"fetching {url}: response of {length} bytes exceeds the limit of {max_bytes} "
                                 "bytes")
            body, total = [], 0
            while chunk := resp.read1(_CHUNK):
                total += len(chunk)
                if total > max_bytes:
                    raise ValueError(f"fetching {url}: response exceeds the limit of {max_bytes} bytes")
                if time.monotonic() > deadline:
                    break
                body.append(chunk)
            # a shut-down socket reads as EOF: the timer decides whether the body is whole
            if expired.is_set() or time.monotonic() > deadline:
                raise TimeoutError
            return b"".join(body)
    except urllib.error.HTTPError as e:
        raise ValueError(f"fetching {url}: HTTP {e.code} {e.reason}") from None
    except (OSError, http.client.HTTPException) as e:
        if expired.is_set() or isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            raise ValueError(f"fetching {url} timed out after {timeout_s:g} s") from None
        raise ValueError(f"fetching {url} failed: {getattr(e, 'reason', None) or e}") from None
    finally:
        timer.cancel()
