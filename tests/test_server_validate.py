"""Request tensors are checked (shape, dtype, range, finiteness) before they touch the model."""
import pytest
import torch

from splitlearn.errors import BadRequest
from splitlearn.server.http import validate
from splitlearn.api.wire import pack

D, MAX_B, MAX_T, V = 8, 4, 16, 257


def test_hidden_accepts_a_good_tensor_and_dequantises_int8():
    x = torch.randn(2, 5, D)
    assert torch.equal(validate.hidden({"h": x}, "h", D, MAX_B, MAX_T), x)
    q = validate.hidden(pack("h", x, "int8"), "h", D, MAX_B, MAX_T)
    assert q.dtype == torch.float32 and torch.allclose(q, x, atol=x.abs().max().item() / 100)


@pytest.mark.parametrize("x, words", [
    (torch.randn(2, 5), "shape"),
    (torch.randn(2, 5, D + 1), "shape"),
    (torch.randn(MAX_B + 1, 5, D), "batch"),
    (torch.randn(1, MAX_T + 1, D), "positions"),
    (torch.full((1, 2, D), float("nan")), "nan"),
    (torch.full((1, 2, D), float("inf")), "inf"),
    (torch.ones(1, 2, D, dtype=torch.int64), "dtype"),
])
def test_hidden_refuses(x, words):
    with pytest.raises(BadRequest, match=f"(?i){words}"):
        validate.hidden({"h": x}, "h", D, MAX_B, MAX_T)


def test_hidden_rows_and_length_and_absent():
    x = torch.randn(2, 3, D)
    with pytest.raises(BadRequest, match="expected 3"):
        validate.hidden({"h": x}, "h", D, MAX_B, MAX_T, rows=3)
    with pytest.raises(BadRequest, match="expected 4"):
        validate.hidden({"h": x}, "h", D, MAX_B, MAX_T, length=4)
    with pytest.raises(BadRequest, match="no tensor 'h'"):
        validate.hidden({}, "h", D, MAX_B, MAX_T)


def test_attention_mask():
    m = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert validate.attention_mask({}, "m", 2, 3, MAX_T) is None
    assert validate.attention_mask({"m": m.bool()}, "m", 2, 3, MAX_T).dtype == torch.int64
    for bad, words in [(m.float(), "integer"), (m[:1], "shape"), (m * 2, "only 0 and 1"),
                       (torch.tensor([[1, 1, 0], [1, 1, 1]]), "pad on the left")]:
        with pytest.raises(BadRequest, match=words):
            validate.attention_mask({"m": bad}, "m", 2, 3, MAX_T)


def test_labels():
    y = torch.tensor([[1, -100, 256]])
    assert torch.equal(validate.labels({"y": y}, "y", 1, 3, V), y)
    for bad, words in [(y.float(), "int64"), (torch.tensor([[1, 2]]), "shape"),
                       (torch.tensor([[1, 2, V]]), "outside"), (torch.tensor([[1, -1, 2]]), "outside")]:
        with pytest.raises(BadRequest, match=words):
            validate.labels({"y": bad}, "y", 1, 3, V)
    with pytest.raises(BadRequest, match="no tensor"):
        validate.labels({}, "y", 1, 3, V)
