"""An ``http.client`` response whose headers are read without the ``email`` package.

``http.client.HTTPResponse.begin`` parses an answer's header block with ``email.parser``
(``http.client.parse_headers``): about 45 us for the five headers of a decode step's answer, the
largest share of the client's own HTTP cost a step (``python benchmarks/decode_profile.py``;
docs/PERFORMANCE.md, 'A decode step's host time'). :class:`LeanResponse` runs the standard
library's own ``begin`` (status line, 100-continue, chunked, keep-alive, lengths: unchanged),
with the header block read line by line into the same :class:`http.client.HTTPMessage` (3 us).
Everything it does not recognise as a plain ``Name: value`` line (an obsolete folded line, a
line without a colon) goes to the standard parser, with the same limits (a line of at most 65,536
bytes, at most 100 headers)."""
from __future__ import annotations

import email.parser
import http.client
import types

_MAXLINE = 65536  # http.client's limits
_MAXHEADERS = 100


def parse_headers(fp) -> http.client.HTTPMessage:
    """The header block at ``fp`` (after the status line) as ``http.client.parse_headers`` reads it."""
    lines = []
    while True:
        line = fp.readline(_MAXLINE + 1)
        if len(line) > _MAXLINE:
            raise http.client.LineTooLong("header line")
        lines.append(line)
        if len(lines) > _MAXHEADERS:
            raise http.client.HTTPException(f"got more than {_MAXHEADERS} headers")
        if line in (b"\r\n", b"\n", b""):
            break
    msg = http.client.HTTPMessage()
    for line in lines[:-1]:
        text = line.decode("iso-8859-1")
        name, colon, value = text.partition(":")
        if not colon or not name or name != name.strip() or text[0] in " \t":  # folded or odd: the standard parser
            return email.parser.Parser(_class=http.client.HTTPMessage).parsestr(
                b"".join(lines).decode("iso-8859-1"))
        msg[name] = value.lstrip(" \t").rstrip("\r\n")
    return msg


class LeanResponse(http.client.HTTPResponse):
    """``http.client.HTTPResponse`` with :func:`parse_headers` (set a connection's
    ``response_class`` to it)."""

    begin = types.FunctionType(http.client.HTTPResponse.begin.__code__,
                               {**vars(http.client), "parse_headers": parse_headers}, "begin")
