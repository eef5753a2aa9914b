"""The digest of tensors made where they lie (splitlearn/api/fingerprint.py): the same on any device,
changed by any byte, by bytes moved, by a name, a shape, a dtype or the metadata."""
import pytest
import torch

from splitlearn.api.fingerprint import digest, digests, fingerprint


def test_any_changed_or_moved_byte_changes_the_sums():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 7).to(torch.bfloat16)  # 210 bytes: padded to whole words
    base = fingerprint(x)
    assert torch.equal(base, fingerprint(x.clone()))
    flat = x.reshape(-1).view(torch.uint8)
    for i in (0, 7, 8, 209):  # first, word end, word start, last (in the pad's word)
        y = flat.clone()
        y[i] ^= 1
        assert not torch.equal(fingerprint(y.view(torch.bfloat16)), base), i
    swapped = x.reshape(-1).clone()
    swapped[[0, 100]] = swapped[[100, 0]]
    assert not torch.equal(fingerprint(swapped), base)  # same multiset of words, moved
    y = torch.randn(40)
    for lo in (1, 2):  # a view at an offset that is no whole word: the same bytes, the same sums
        assert torch.equal(fingerprint(y[lo:lo + 16]), fingerprint(y[lo:lo + 16].clone()))


def test_chunks_do_not_change_the_sums(monkeypatch):
    from splitlearn.api import fingerprint as fp

    x = torch.randn(1001, generator=torch.Generator().manual_seed(5))  # 4004 bytes: 501 words
    whole = fingerprint(x)
    monkeypatch.setattr(fp, "CHUNK_WORDS", 64)
    assert torch.equal(fingerprint(x), whole)


def test_the_digest_names_the_tensors_and_the_metadata():
    h = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(3))
    ds = digests([({"hidden": h}, {"step": "1"}), ({"hidden": h.clone()}, {"step": "1"}),
                  ({"hidden": h + 1}, {"step": "1"}), ({"hidden": h}, {"step": "2"}),
                  ({"grad": h}, {"step": "1"}), ({"hidden": h.reshape(4, 2, 8)}, {"step": "1"}),
                  ({"hidden": h.double()}, {"step": "1"}), ({}, None)])
    assert ds[0] == ds[1] and len(set(ds)) == len(ds) - 1
    assert digest({"hidden": h}, {"step": "1"}) == ds[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_sums_are_the_same_on_the_gpu():
    x = torch.randn(1000, 33, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert torch.equal(fingerprint(x.cuda()).cpu(), fingerprint(x))
    assert digest({"x": x.cuda()}) == digest({"x": x})
