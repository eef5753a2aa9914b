"""The lean path's answers: headers read without the email package, exactly as http.client reads them."""
import http.client
import io

import pytest

from splitlearn.transport.leanresponse import LeanResponse, parse_headers

BLOCKS = [
    b"Content-Length: 180\r\nContent-Type: application/octet-stream\r\nX-Server-Time-Ms: 0.812\r\n"
    b"Server: waitress\r\n\r\nBODY",
    b"A: 1\r\nA: 2\r\nB:x  \r\nEmpty:\r\n\r\n",
    b"A: 1\r\n  folded\r\nB: 2\r\n\r\n",  # obsolete folding: the standard parser's reading
    b"Bad line\r\nC: 3\r\n\r\n",
    b" Lead: 1\r\n\r\n",
    b"X: y\n\n",
    b"\r\n",
    b"",
]


@pytest.mark.parametrize("raw", BLOCKS)
def test_headers_are_those_http_client_reads(raw):
    ours, theirs = io.BytesIO(raw), io.BytesIO(raw)
    a, b = parse_headers(ours), http.client.parse_headers(theirs)
    assert isinstance(a, http.client.HTTPMessage)
    assert a.items() == b.items() and a.get_all("A") == b.get_all("A")
    assert ours.tell() == theirs.tell()  # the body starts where it did


def test_limits_are_http_clients():
    with pytest.raises(http.client.LineTooLong):
        parse_headers(io.BytesIO(b"A: " + b"x" * 70000 + b"\r\n\r\n"))
    with pytest.raises(http.client.HTTPException, match="more than 100 headers"):
        parse_headers(io.BytesIO(b"A: 1\r\n" * 101 + b"\r\n"))


class _Sock:
    def __init__(self, data: bytes):
        self.data = data

    def makefile(self, mode):
        return io.BytesIO(self.data)


@pytest.mark.parametrize("cls", [LeanResponse, http.client.HTTPResponse])
def test_a_response_reads_the_same(cls):
    raw = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 429 Too Many Requests\r\nContent-Length: 5\r\n"
           b"Retry-After: 3\r\nConnection: close\r\n\r\nhello, and what follows")
    r = cls(_Sock(raw), method="POST")
    r.begin()
    assert (r.status, r.reason, r.getheader("retry-after"), r.will_close, r.read()) == \
        (429, "Too Many Requests", "3", True, b"hello")
    chunked = cls(_Sock(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"), method="POST")
    chunked.begin()
    assert (chunked.chunked, chunked.will_close, chunked.read()) == (True, False, b"abc")
