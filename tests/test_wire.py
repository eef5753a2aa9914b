"""splitlearn.api.wire: safetensors bytes in, the same tensors out; anything malformed is a BadRequest."""
import json
import struct

import pytest
import torch

from splitlearn.api import wire
from splitlearn.errors import BadRequest
from splitlearn.api.wire import (check_wire_dtype, decode, encode, pack, quantize_int8, read_metadata,
                             unpack)


def _activations(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 3.0


def _header(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_is_exact_in_the_wire_dtype(wire_dtype):
    x = _activations(2, 5, 32)
    tensors, meta = decode(encode(pack("hidden", x, wire_dtype), {"step": 3}))
    y = unpack(tensors, "hidden")
    assert y.dtype == getattr(torch, wire_dtype)
    assert y.shape == x.shape
    assert torch.equal(y, x.to(getattr(torch, wire_dtype)))  # bit-exact after the cast
    assert meta == {"step": "3"}


def test_float32_round_trip_keeps_every_bit():
    x = _activations(3, 4, 8)
    x[0, 0, 0] = float("1e-40")  # a subnormal survives too
    out, _ = decode(encode({"x": x}))
    assert torch.equal(out["x"], x)


def test_int8_error_is_at_most_half_a_step_per_row():
    x = _activations(4, 16, 64)
    x[1, 2] = 0.0  # an all-zero row must come back as zeros, not NaN
    x[2, 3, 5] = 1e4  # one outlier only coarsens its own row
    tensors, _ = decode(encode(pack("grad", x, "int8")))
    assert tensors["grad"].dtype == torch.int8
    assert tensors["grad.scale"].shape == (4, 16, 1)
    deq = unpack(tensors, "grad")
    _, scale = quantize_int8(x)
    err = (x - deq).abs()  # (4, 16, 64)
    assert bool((err <= scale / 2 * (1 + 1e-5)).all())
    assert torch.equal(deq[1, 2], torch.zeros(64))
    # the outlier's row is coarse, its neighbours are not
    assert float(scale[2, 3]) > 70.0 and float(scale[2, 4]) < 0.2


def test_bytes_on_the_wire_are_the_raw_bytes_plus_a_small_header():
    x = _activations(4, 128, 768)
    raw = x.numel() * 4
    body = encode(pack("hidden", x, "float32"), {"client_id": "c1", "step": 17, "wire_dtype": "float32"})
    assert raw <= len(body) <= raw + 1024
    half = encode(pack("hidden", x, "bfloat16"))
    assert raw // 2 <= len(half) <= raw // 2 + 1024
    q = encode(pack("hidden", x, "int8"))
    assert len(q) <= raw // 4 + 4 * 128 * 4 + 1024  # int8 values + one float32 scale per row


def test_metadata_round_trips_as_strings():
    meta = {"client_id": "alice-1", "step": 5, "wire_dtype": "int8", "note": "é ü"}
    body = encode({"t": torch.zeros(1)}, meta)
    assert read_metadata(body) == {k: str(v) for k, v in meta.items()}
    assert decode(body)[1] == read_metadata(body)
    assert read_metadata(encode({"t": torch.zeros(1)})) == {}


GOOD = encode({"hidden": torch.ones(2, 3, 4)}, {"step": "1"})


@pytest.mark.parametrize("body, words", [
    (b"", "0 bytes"),
    (b"abc", "3 bytes"),
    (struct.pack("<Q", 10_000) + b"{}", "header of 10000"),
    (struct.pack("<Q", 1 << 40) + b"{}", "header of"),
    (struct.pack("<Q", 7) + b"not-js!", "not JSON"),
    (struct.pack("<Q", 2) + b"\xff\xfe", "not JSON"),
    (GOOD[:-5], "not valid safetensors"),  # data truncated
    (_header({"__metadata__": {"step": 1}}), "__metadata__"),
    (_header({"__metadata__": ["a"]}), "__metadata__"),
    (_header([1, 2]) , "__metadata__"),
    (_header({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}), "not valid"),
    (_header({"x": {"dtype": "Q99", "shape": [1], "data_offsets": [0, 1]}}) + b"\0", "not valid"),
])
@pytest.mark.parametrize("view", [False, True], ids=["bytes", "shared-memory view"])
def test_malformed_bodies_raise_bad_request(body, words, view):
    with pytest.raises(BadRequest) as e:
        decode(memoryview(bytearray(body)) if view else body)
    assert words in str(e.value)
    assert e.value.status == 400


def test_int8_without_its_scale_is_refused():
    q = pack("grad", _activations(2, 3, 8), "int8")
    with pytest.raises(BadRequest, match="grad.scale"):
        unpack(decode(encode({"grad": q["grad"]}))[0], "grad")
    wrong = {"grad": q["grad"], "grad.scale": q["grad.scale"][:, :1]}  # wrong shape
    with pytest.raises(BadRequest, match="grad.scale"):
        unpack(wrong, "grad")
    wrong = {"grad": q["grad"], "grad.scale": q["grad.scale"].half()}  # wrong dtype
    with pytest.raises(BadRequest, match="float32"):
        unpack(wrong, "grad")


def test_unpack_refuses_missing_and_integer_activations():
    with pytest.raises(BadRequest, match="no tensor 'hidden'"):
        unpack({"other": torch.zeros(1)}, "hidden")
    with pytest.raises(BadRequest, match="int64"):
        unpack({"hidden": torch.zeros(1, 2, 3, dtype=torch.int64)}, "hidden")


def test_wire_dtype_names_are_checked():
    assert check_wire_dtype("bfloat16") == "bfloat16"
    with pytest.raises(BadRequest, match="float64"):
        check_wire_dtype("float64")


def test_encode_writes_safetensors_the_library_reads():
    from safetensors.torch import load as st_load

    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(2, 3, 4, generator=g), "bf16": torch.randn(3, 5, generator=g).bfloat16(),
               "f16": torch.randn(7, generator=g).half(), "i8": torch.tensor([-127, 0, 127], dtype=torch.int8),
               "i64": torch.arange(6).reshape(2, 3), "flag": torch.tensor([True, False]),
               "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
               "strided": torch.randn(4, 6, generator=g).t()}  # not contiguous
    body = wire.encode(tensors, {"step": 3})
    assert isinstance(body, bytes)
    (n,) = struct.unpack("<Q", body[:8])
    assert n % 8 == 0  # data 8-byte aligned, as safetensors.torch.save writes it
    back = st_load(body)
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    assert wire.read_metadata(body) == {"step": "3"}
    payload = sum(v.numel() * v.element_size() for v in tensors.values())
    assert len(body) - payload < 1024  # raw bytes plus a small header


def test_the_library_s_bodies_decode_the_same_from_bytes_and_views():
    from safetensors.torch import save as st_save

    g = torch.Generator().manual_seed(1)
    tensors = {"f32": torch.randn(2, 3, generator=g), "bf16": torch.randn(4, generator=g).bfloat16(),
               "f16": torch.randn(3, 1, generator=g).half(), "f64": torch.randn(2, generator=g).double(),
               "i8": torch.tensor([-127, 3], dtype=torch.int8), "u8": torch.tensor([0, 255], dtype=torch.uint8),
               "i16": torch.arange(3, dtype=torch.int16), "i32": torch.arange(4, dtype=torch.int32),
               "i64": torch.tensor([-(10 ** 12), 10 ** 12]), "flag": torch.tensor([True, False]),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    body = st_save(tensors, metadata={"step": "4"})
    for form in (body, bytearray(body), memoryview(body), memoryview(bytearray(body))):
        out, meta = decode(form)
        assert meta == {"step": "4"} and out.keys() == tensors.keys()
        for k, v in tensors.items():
            assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k], v), k
        out["f32"].add_(1)  # memory of its own, writable
        assert torch.equal(decode(body)[0]["f32"], tensors["f32"])


def test_a_repeated_header_is_checked_once_and_still_refuses_a_short_body():
    """decode(..., repeats=True) reuses the checked form of a header it met over a body of the
    same size. The attack it must not open: the same header over a truncated body (its tensors'
    bytes no longer there) read past the end."""
    body = encode({"hidden": _activations(1, 1, 8)}, {"step": "1"})
    out, meta = decode(body, repeats=True)
    meta["step"] = "changed by the caller"
    again, meta2 = decode(memoryview(bytearray(body)), repeats=True)
    assert meta2 == {"step": "1"} and torch.equal(again["hidden"], out["hidden"])
    with pytest.raises(BadRequest, match="outside the data"):
        decode(body[:-4], repeats=True)
    with pytest.raises(BadRequest, match="not safetensors"):
        decode(body[:6], repeats=True)
    empty = encode({"none": torch.zeros(0, 3)})  # a header over no data, then one whose length prefix lies
    decode(empty, repeats=True)
    lying = struct.pack("<Q", len(empty) - 8 + 40) + empty[8:]
    with pytest.raises(BadRequest, match="truncated"):
        decode(lying, repeats=True)


# -- shared memory: Encoded.write_into and decode of a memoryview (the unix transport's region) --

def test_a_body_written_into_a_buffer_and_read_in_place_is_the_same_tensors_and_bytes():
    import mmap
    tensors = {"hidden": _activations(2, 3, 16), "mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
               "half": _activations(4, seed=1).to(torch.bfloat16), "empty": torch.zeros(0, 3)}
    region = mmap.mmap(-1, 1 << 16)
    e = wire.Encoded(tensors, {"step": 7})
    n = e.write_into(region, 64)
    assert n == len(e) and bytes(region[64:64 + n]) == encode(tensors, {"step": 7}) == bytes(e)
    view = memoryview(region)[64:64 + n]
    out, meta = decode(view)
    assert meta == {"step": "7"} and set(out) == set(tensors)
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v)
    region[64:64 + n] = b"\0" * n  # the buffer is reused by the next request: what was read is its own
    assert torch.equal(out["hidden"], tensors["hidden"])
    del out, view
    region.close()  # nothing still points into it (a view left would raise BufferError here)


def test_a_view_whose_tensors_overlap_is_refused_before_anything_is_allocated():
    # the attack: 100 tensors all pointing at the same 4 KiB of data would make a copying reader
    # allocate 100x the body; safetensors refuses overlap, and so does the view reader
    head = {f"t{i}": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]} for i in range(100)}
    body = bytearray(_header(head) + b"\0" * 4096)
    with pytest.raises(BadRequest, match="overlap"):
        decode(memoryview(body))
    with pytest.raises(BadRequest):
        decode(bytes(body))


@pytest.mark.parametrize("entry, words", [
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "does not fill"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "shape"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}, "outside the data"),
    ({"dtype": "F32", "shape": [1]}, "must have dtype, shape, data_offsets"),
    ({"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}, "65 dimensions"),
])
def test_a_view_with_a_lying_header_is_a_bad_request(entry, words):
    body = _header({"x": entry}) + b"\0" * 4
    for form in (memoryview(bytearray(body)), body):
        with pytest.raises(BadRequest, match=words):
            decode(form)


# degenerate shapes (issue 40, item 6): [0, 2**70] has zero bytes, so it fit its (empty) data,
# and numpy's reshape raised a ValueError: a 500 with a traceback on every door
DEGENERATE_SHAPES = [[0, 2 ** 70], [2 ** 70, 0], [0, 2 ** 62], [0, 2 ** 40, 2 ** 40], [0, 2 ** 48 + 1],
                     [0] * 65, [-1, 0], [0, -(2 ** 70)], [0.0, 1], [0, 1.5], ["0"], [True, 0], [None], [[0]],
                     None, "0", {"0": 0}, 0]


@pytest.mark.parametrize("shape", DEGENERATE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ["F32", "I64", "BF16"])
def test_a_degenerate_shape_is_a_bad_request_on_every_reader(shape, dtype):
    entry = {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}
    head = _header({"x": entry})
    for form in (head, memoryview(bytearray(head)), wire.DeviceBody(head, torch.zeros(0, dtype=torch.uint8))):
        with pytest.raises(BadRequest, match="shape|dimensions"):
            decode(form)


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}, 32, None])
def test_a_dtype_that_is_not_a_name_is_a_bad_request(dtype):
    with pytest.raises(BadRequest, match="dtype"):
        decode(_header({"x": {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}}) + b"\0" * 4)


def test_empty_tensors_of_sane_shapes_still_decode():
    tensors = {"a": torch.zeros(0, 3), "b": torch.zeros(2, 0, 5, dtype=torch.int64), "c": torch.zeros(())}
    out, _ = decode(encode(tensors))
    assert {k: (v.shape, v.dtype) for k, v in out.items()} == {k: (v.shape, v.dtype) for k, v in tensors.items()}
    head = _header({"x": {"dtype": "F32", "shape": [0, 2 ** 48], "data_offsets": [0, 0]}})  # the bound itself
    assert decode(head)[0]["x"].shape == (0, 2 ** 48)


# -- a device body: the header inline, the data in a (device) region --------------------------
# On the CPU here (a uint8 tensor stands for the CUDA region); tests/test_transport_cuda.py
# runs the same on a GPU, across two processes.

def test_a_device_body_is_the_same_tensors_and_its_region_can_be_reused():
    tensors = {"hidden": _activations(2, 3, 16), "half": _activations(3, seed=1).to(torch.float16),
               "mask": torch.tensor([[0, 1, 1], [1, 1, 1]]), "empty": torch.zeros(0, 3)}
    e = wire.Encoded(tensors, {"step": 7}, keep_device=True)  # CPU tensors: no device to keep
    assert e.device is None
    region = torch.zeros(1 << 12, dtype=torch.uint8)
    n = e.write_data(region)
    assert len(e.head) + n == len(e) and bytes(e.head) + bytes(region[:n].numpy()) == bytes(e)
    out, meta = decode(wire.DeviceBody(e.head, region[:n]))
    assert meta == {"step": "7"} and set(out) == set(tensors)
    for k, v in tensors.items():  # float16 after 96 bytes of float32, int64 after 6 of float16: aligned anyway
        assert out[k].dtype == v.dtype and torch.equal(out[k], v)
    region.zero_()
    assert torch.equal(out["hidden"], tensors["hidden"])


@pytest.mark.parametrize("head, data, words", [
    (_header({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}), 4, "outside the data"),
    (_header({f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]} for i in range(3)}), 4, "overlap"),
    (_header({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}) + b"\0\0\0\0", 4, "header only"),
    (b"\x05\0\0", 4, "not safetensors"),
])
def test_a_device_body_with_a_lying_header_is_a_bad_request(head, data, words):
    with pytest.raises(BadRequest, match=words):
        decode(wire.DeviceBody(head, torch.zeros(data, dtype=torch.uint8)))
