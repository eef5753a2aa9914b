"""The unix:// transport's device region (splitlearn/transport/cudaregion.py): a client whose
tensors are on the GPU the server computes on sends and receives them through CUDA memory both
processes map (never through host memory), with the same answers as HTTP; a hostile device
region or descriptor gets a clean error. Skipped without a CUDA GPU."""
import array
import copy
import json
import os
import socket
import tempfile

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.api import wire
from splitlearn.hf import SplitGPT2LMHeadModel
from splitlearn.transport import Transport, TransportConfig
from splitlearn.transport import unixframe as F
from splitlearn.transport.unix import Connection
from splitlearn.api.wire import encode, pack

from conftest import VARIED
from serverproc import TOKEN, ServerProcess

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

D = 32  # models/tiny.json
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": P.CONTENT_TYPE}


@pytest.fixture(scope="module")
def server():
    d = tempfile.mkdtemp(prefix="sl-cuda-")
    path = os.path.join(d, "server.sock")
    with ServerProcess((1, 3), optimizer="sgd", lr=0.1, model=VARIED,
                       extra=["--listen", "unix://" + path, "--device", "cuda"]) as srv:
        srv.unix_path, srv.unix_url = path, "unix://" + path
        yield srv


@pytest.fixture
def no_host_copies(monkeypatch):
    """Fails a test in which a CUDA tensor of the body is copied to host memory by the encoder."""
    seen = []
    for name in ("__bytes__", "write_into"):
        orig = getattr(wire.Encoded, name)

        def spy(self, *a, _orig=orig, **k):
            seen.extend(v.device.type for v in self.tensors)
            return _orig(self, *a, **k)
        monkeypatch.setattr(wire.Encoded, name, spy)
    yield seen


def _hidden(seed: int, B: int = 2, T: int = 5, device="cuda") -> dict:
    h = torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed)).to(device)
    return {**pack(P.HIDDEN, h, "float32"), P.MASK: torch.ones(B, T, dtype=torch.long, device=device)}


@pytest.mark.parametrize("rows", [(2, 5), (4, 64)])
def test_a_forward_crosses_the_device_region_with_the_same_answer(server, rows, no_host_copies):
    http = Transport(TransportConfig(server.url, TOKEN))
    unix = Transport(TransportConfig(server.unix_url, TOKEN))
    try:
        a, ma = http.call_meta(P.FORWARD, _hidden(0, *rows, device="cpu"), {"wire_dtype": "float32"})
        no_host_copies.clear()
        b, mb = unix.call_meta(P.FORWARD, _hidden(0, *rows), {"wire_dtype": "float32"})
        assert "cuda" not in no_host_copies  # the client wrote its tensors device to device
        assert unix.stats.host_copy_bytes == 0  # nor read the answer through host memory (WireStats)
        conn = unix.link._lanes[0]
        assert conn.device_region is not None and conn.device_region.device.type == "cuda"
        assert b[P.HIDDEN].is_cuda and ma == mb
        assert torch.equal(a[P.HIDDEN], b[P.HIDDEN].cpu())
    finally:
        http.close()
        unix.close()


def test_over_tcp_a_cuda_tensor_is_copied_once_each_way_through_pinned_memory(server):
    """The lean HTTP path: each tensor copied once, device to pinned host memory, sent from there
    (a memoryview, not joined into bytes); the answer decoded once (WireStats.host_copy_bytes)."""
    t = Transport(TransportConfig(server.url, TOKEN))
    try:
        body = _hidden(0, 4, 64)
        a, _ = t.call_meta(P.FORWARD, body, {"wire_dtype": "float32"})
        sent = sum(v.numel() * v.element_size() for v in body.values())
        got = sum(v.numel() * v.element_size() for v in a.values())
        assert t.stats.host_copy_bytes == sent + got
        enc = wire.Encoded(body, {}, keep_device=True)
        view = enc.host_body()
        assert isinstance(view, memoryview) and bytes(view) == bytes(wire.Encoded(body, {}))
        assert enc.host_copied == sent
    finally:
        t.close()


def test_generation_on_the_gpu_is_the_unsplit_models(server, varied_model, padded_batch):
    """Left-padded prompts (masks cross too) on the GPU: both transports give the unsplit
    model's greedy tokens, and the tokens vary (a drifting cache would show)."""
    ids, mask = (t.cuda() for t in padded_batch)
    want = copy.deepcopy(varied_model).cuda().generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                                       do_sample=False, pad_token_id=256)
    assert want[:, -8:].unique().numel() > 2
    for url in (server.url, server.unix_url):
        model = SplitGPT2LMHeadModel.from_pretrained(VARIED, server=url, token=TOKEN, client_id="gen").cuda().eval()
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=256)
        model.remote.close()
        assert torch.equal(got, want), url


def test_training_on_the_gpu_is_the_same_over_both_transports():
    """Two fresh servers on the GPU (same seed), one over HTTP, one over unix:// with device
    regions: two SGD steps give the same losses, and the loss falls."""
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3)).cuda()
    path = os.path.join(tempfile.mkdtemp(prefix="sl-cuda-"), "train.sock")
    flags = dict(optimizer="sgd", lr=0.1, model=VARIED)
    results = []
    with ServerProcess((1, 3), extra=["--device", "cuda"], **flags) as plain, \
            ServerProcess((1, 3), extra=["--device", "cuda", "--listen", "unix://" + path], **flags):
        for url in (plain.url, "unix://" + path):
            model = SplitGPT2LMHeadModel.from_pretrained(VARIED, server=url, token=TOKEN, client_id="train").cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []
            for _ in range(2):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            model.remote.close()
            results.append(losses)
    assert results[0] == pytest.approx(results[1], rel=1e-5) and results[0][1] < results[0][0]


def test_the_echo_returns_device_tensors(server):
    t = Transport(TransportConfig(server.unix_url, TOKEN))
    try:
        x = torch.randn(1 << 18, device="cuda")
        back = t.call(P.ECHO, {"x": x})["x"]
        assert back.is_cuda and torch.equal(back, x)
    finally:
        t.close()


# -- hostile device regions and descriptors ---------------------------------------------------

def _answer(s: socket.socket):
    r = F.Reader(s)
    kind, ml, bl = F.unpack_header(r.take(F.HEADER.size), 1 << 30)
    return F.parse_meta(r.take(ml)), r.take(bl) if bl else b""


def _memfd(size: int) -> int:
    import fcntl
    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


@pytest.mark.parametrize("case, words", [
    ("memfd as device", "cannot be mapped"), ("one fd", "exactly two"),
    ("bad size", "multiple of"), ("bad field", "device must be"),
])
def test_a_hostile_device_region_is_refused(server, case, words):
    from splitlearn.transport import cudaregion

    size = 1 << 21
    region, dev_fd = cudaregion.DeviceRegion.create(torch.device("cuda", 0), size)
    fds = [_memfd(size)] + {"memfd as device": [_memfd(size)], "one fd": []}.get(case, [dev_fd])
    device = {"bytes": region.size + (1 if case == "bad size" else 0), "uuid": cudaregion.uuid(torch.device("cuda"))}
    if case == "bad field":
        device = {"bytes": region.size}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.unix_path)
    try:
        s.sendmsg([F.pack(F.HELLO, {"version": F.VERSION, "region_bytes": size, "device": device})],
                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        meta, body = _answer(s)
        assert meta["status"] == 400 and words in json.loads(body)["message"], body
    finally:
        s.close()
        for fd in fds + [dev_fd]:
            try:
                os.close(fd)
            except OSError:
                pass
        region.close()
    c = Connection(server.unix_path, device=torch.device("cuda"))  # the server still maps honest regions
    assert c.device_region is not None
    c.close()


def test_a_device_descriptor_is_checked_against_its_connections_region(server):
    """Offsets beyond B's device region, a device body sent to a JSON route, and a header that
    points outside the data: 400 each, A's region untouched."""
    a = Connection(server.unix_path, device=torch.device("cuda"))
    b = Connection(server.unix_path, device=torch.device("cuda"))
    try:
        a.device_region.tensor.fill_(7)
        torch.cuda.synchronize()
        enc = wire.Encoded(_hidden(1), {"wire_dtype": "float32"}, keep_device=True)
        n = enc.write_data(b.device_region.tensor)
        torch.cuda.synchronize()
        lying = bytearray(enc.head)
        for case, meta, head, words in (
                ("outside", {"method": "POST", "path": P.FORWARD, "device": [b.device_region.size, 16]}, enc.head, "outside"),
                ("json route", {"method": "GET", "path": P.INFO, "device": [0, n]}, enc.head, "tensor route"),
                ("lying header", {"method": "POST", "path": P.FORWARD, "device": [0, 64]}, bytes(lying), "safetensors")):
            meta["headers"] = HEADERS
            b.sock.sendall(F.pack(F.REQUEST, meta, len(head)) + head)
            status, _, content = b._read_answer()
            assert status == 400 and words in json.loads(content)["message"], (case, content)
        status, _, content = b.request("POST", P.FORWARD, HEADERS, encode(_hidden(2, device="cpu"), {"wire_dtype": "float32"}))
        assert status == 200  # B's connection goes on
        assert bool((a.device_region.tensor == 7).all())
    finally:
        a.close()
        b.close()
