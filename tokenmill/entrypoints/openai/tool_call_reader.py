"""One tool call's JSON object read as the model writes it, a character at a time across chunks, for the
"auto" tool-call parsers (tool_parsers.py): what has been read of its arguments is always the start of what
they will be, so they stream as they are written."""
from __future__ import annotations

import json
import re


WHITESPACE = " \t\r\n"
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # a run of a string's characters that are taken as they are
_ESCAPES = {chr(i): json.dumps(chr(i))[1:-1] for i in range(32)}  # a raw control character: its JSON escape
_SCALAR_END = frozenset(WHITESPACE + ',:{}[]"')


def _decode(pieces: list[str]):
    """A JSON string's (or number's) raw text, decoded; None where it is not JSON."""
    try:
        return json.loads("".join(pieces), strict=False)
    except ValueError:
        return None


class CallReader:
    """One call object, {"name": "f", "arguments": {...}}, read as it is written, a character at a time across
    chunks; or, given the name, the arguments value alone (mistral's name[ARGS]{...}).

    The arguments are the text of their value as written: an object or array streams as it comes (`args`, the
    part not yet taken); a string value is the arguments' text itself, and goes once it is complete; another
    value (a number) goes as written. It is a call (`call`) once the name is read, a string, and the arguments
    have begun, or the object ended without any ("{}"). Until then anything off (no object, a key that is no
    string, a name that is no string, the end without a name) makes it none (`bad`): its text is content. After,
    the object's syntax no longer matters: only its end is looked for."""

    def __init__(self, args_keys: tuple[str, ...] = ("arguments",), name: str | None = None):
        self.args_keys = args_keys
        self.bare = name is not None  # the value read is the arguments themselves
        self.name = name  # once read; False: it is no string, or not text
        self.index = None  # the call's number among the choice's calls, once it is one (the parser's)
        self.depth = 0
        self.string = self.escaped = self.scalar = False
        self.expect = "{"  # at the object's own level: "{", "key0" (a key or its end), "key", ":", "value", ","
        self.key = None  # the last key read
        self.role = None  # the value being read at the object's level: "key", "name", "args" or None
        self.args_key_seen = False  # (the first of args_keys to come is the arguments)
        self.sink = None  # where what is read goes (a list), or None
        self.capture = None  # the raw text of a key, the name, or arguments that are no object or array
        self.args = None  # the arguments' text not yet taken (a list); None until they begin
        self.args_done = self.done_sent = False
        self.closed = self.bad = self.loose = False

    @property
    def call(self) -> bool:
        return isinstance(self.name, str) and self.args is not None and not self.bad

    def feed(self, text: str) -> int:
        """Reads `text` up to the object's end (or until it is no call); returns how much it read."""
        i, n = 0, len(text)
        while i < n and not (self.closed or self.bad):
            c = text[i]
            if self.string:
                if self.escaped:
                    self.escaped = False
                elif c == '"':
                    self.string = False
                elif c == "\\":
                    self.escaped = True
                elif c < " ":
                    c = _ESCAPES[c]
                else:
                    j = _PLAIN.match(text, i).end()
                    if self.sink is not None:
                        self.sink.append(text[i:j])
                    i = j
                    continue
                i += 1
                if self.sink is not None:
                    self.sink.append(c)
                if not self.string and self.depth == 1 and not (self.bare or self.loose):
                    self._value_end()
                continue
            if self.scalar:
                if c not in _SCALAR_END:
                    if self.sink is not None:
                        self.sink.append(c)
                    i += 1
                    continue
                self.scalar = False
                self._value_end()
                continue  # (c is read again: it follows the value)
            i += 1
            if self.depth == 0:
                if c in WHITESPACE:
                    continue
                if self.bare and c in "{[":
                    self.depth, self.args = 1, [c]
                    self.sink = self.args
                elif c == "{" and not self.bare:
                    self.depth, self.expect = 1, "key0"
                else:
                    self.bad = True
            elif self.depth > 1 or self.bare or self.loose:
                self._nested(c)
            elif c not in WHITESPACE:
                self._own(c)
        return i

    def _nested(self, c: str) -> None:
        """Inside a value (or a bare or loose object): strings and brackets, to find where it ends."""
        if self.sink is not None:
            self.sink.append(c)
        if c == '"':
            self.string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.closed = True
                self.args_done = self.args_done or self.bare
            elif self.depth == 1 and not (self.bare or self.loose):
                self._value_end()

    def _own(self, c: str) -> None:
        """The call object's own syntax: keys, colons, values and commas."""
        e = self.expect
        if e in ("key0", "key"):
            if c == '"':
                self.string, self.role = True, "key"
                self.capture = self.sink = [c]
            elif c == "}" and e == "key0":
                self._close()
            else:
                self._fail()
        elif e == ":":
            if c == ":":
                self.expect = "value"
            else:
                self._fail()
        elif e == "value":
            role = None
            if self.key == "name" and self.name is None:
                role = "name"
            elif self.key in self.args_keys and not self.args_key_seen:
                role, self.args_key_seen = "args", True
            self.role = role
            if role == "name" and c != '"':
                self.name = False  # a name that is no string
                self._fail()
            elif c in "{[":
                self.depth = 2
                if role == "args":
                    self.args = [c]
                self.sink = self.args if role == "args" else None
            elif c == '"':
                self.string = True
                self.capture = self.sink = [c] if role else None
            else:
                self.scalar = True
                self.capture = self.sink = [c] if role else None
        elif c == ",":
            self.expect = "key"
        elif c == "}":
            self._close()
        else:
            self._fail()

    def _value_end(self) -> None:
        """A value at the object's own level (or a key) ended."""
        role, capture = self.role, self.capture
        self.role = self.sink = self.capture = None
        self.expect = ","
        if role == "key":
            self.key, self.expect = _decode(capture), ":"
            if not isinstance(self.key, str):
                self._fail()
        elif role == "name":
            name = _decode(capture)
            try:
                name.encode("utf-8")  # (a lone surrogate, "\\udc00", is no name; nor is "")
                self.name = name or False
            except (AttributeError, UnicodeEncodeError):
                self.name = False
            if self.name is False:
                self._fail()
        elif role == "args":
            if self.args is None:  # a string (its text is the arguments) or a bare value
                if capture[0] == '"':
                    text = _decode(capture)
                    if text is None:
                        return self._fail()
                    self.args = [text.encode("utf-8", "backslashreplace").decode("utf-8")]
                else:
                    self.args = ["".join(capture)]
            self.args_done = True

    def _close(self) -> None:
        self.depth, self.closed = 0, True
        if self.args is None:
            self.args, self.args_done = ["{}"], True
        if not self.call:
            self.bad = True

    def _fail(self) -> None:
        if self.call:
            self.loose, self.sink = True, None
        else:
            self.bad = True
