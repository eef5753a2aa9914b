"""Segment, SegmentCache and the helpers that make a segment behave like its part of GPT-2."""
import pytest
import torch

from conftest import hf_forward
import splitlearn as sl
from splitlearn import Segment, SegmentCache, partition
from splitlearn.model.segments import labels_from_batch, loss_from_logits, positions_from_mask


def test_positions_from_mask_match_generate():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert positions_from_mask(mask, 5).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert positions_from_mask(mask, 2).tolist() == [[1, 2], [3, 4]]  # the newest columns


def test_labels_ignore_padding():
    ids = torch.tensor([[7, 7, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1]])
    assert labels_from_batch(ids, mask).tolist() == [[-100, -100, 3, 4]]
    assert labels_from_batch(ids, None) is ids


def test_loss_from_logits_is_the_hf_loss(tiny_model, padded_batch):
    ids, mask = padded_batch
    labels = labels_from_batch(ids, mask)
    out = hf_forward(tiny_model, ids, mask, labels=labels)
    torch.testing.assert_close(loss_from_logits(out.logits, labels), out.loss, rtol=0, atol=1e-6)


def test_segment_describes_itself(tiny_model):
    bottom, trunk, top = partition(tiny_model, (1, 3))
    assert (bottom.input_kind(), trunk.input_kind(), top.input_kind()) == ("ids", "hidden", "hidden")
    assert (bottom.has_embeddings, bottom.has_head) == (True, False)
    assert (trunk.has_embeddings, trunk.has_head) == (False, False)
    assert (top.has_embeddings, top.has_head) == (False, True)
    assert "kind=trunk, blocks=[1, 3)" in repr(trunk)


def test_hf_state_dict_uses_global_hugging_face_names(tiny_model):
    bottom, trunk, top = partition(tiny_model, (1, 3))
    full = tiny_model.state_dict()
    assert set(trunk.hf_state_dict()) == {k for k in full if k.startswith(("transformer.h.1.", "transformer.h.2."))}
    assert "transformer.wte.weight" in bottom.hf_state_dict()
    assert {"transformer.ln_f.weight", "lm_head.weight"} <= set(top.hf_state_dict())
    for seg in (bottom, trunk, top):
        for name, t in seg.hf_state_dict().items():
            assert t is full[name] or torch.equal(t, full[name]), name


def test_shapes_through_the_segments(tiny_model, batch):
    bottom, trunk, top = partition(tiny_model, (1, 3))
    d, V = tiny_model.config.n_embd, tiny_model.config.vocab_size
    h = bottom(batch)
    assert h.shape == (*batch.shape, d)
    assert trunk(h).shape == (*batch.shape, d)
    assert top(trunk(h)).shape == (*batch.shape, V)


def test_unknown_kind_is_refused(tiny_model):
    with pytest.raises(ValueError, match="kind"):
        Segment(tiny_model.config, "middle", 0, 1)


def test_mask_that_does_not_cover_the_sequence_is_refused(tiny_model, batch):
    bottom = partition(tiny_model, 2).bottom
    with pytest.raises(ValueError, match="attention_mask covers 11 positions"):
        bottom(batch, torch.ones(2, 11, dtype=torch.long))


def test_position_past_n_positions_is_refused(tiny_model):
    bottom = partition(tiny_model, 2).bottom
    n = tiny_model.config.n_positions
    with pytest.raises(ValueError, match="n_positions"):
        bottom(torch.zeros(1, n + 1, dtype=torch.long))


@pytest.mark.parametrize("cuts", [(0,), (2,), (4,), (1, 3)])
def test_caches_advance_and_decode_equals_full_forward(tiny_model, padded_batch, cuts):
    """Prefill then one cached step gives the logits of a full forward on prompt + token."""
    ids, mask = padded_batch
    parts = partition(tiny_model, cuts)
    caches = parts.new_caches()
    assert all(isinstance(c, SegmentCache) and c.length == 0 for c in caches)
    with torch.no_grad():
        parts(ids, mask, caches)
        assert [c.length for c in caches] == [ids.shape[1]] * len(parts)
        nxt = torch.tensor([[5], [6], [7]])
        mask2 = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        step = parts(nxt, mask2, caches)  # (B, 1, V)
        full = hf_forward(tiny_model, torch.cat([ids, nxt], 1), mask2).logits
    assert [c.length for c in caches] == [ids.shape[1] + 1] * len(parts)
    torch.testing.assert_close(step[:, -1], full[:, -1], rtol=0, atol=1e-5)


def test_logits_to_keep_gives_the_last_positions_logits():
    model = sl.load_model("tiny")
    parts = sl.partition(model, (2,))
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = parts.bottom(ids)
        full = parts.top(h)  # (B, T, V)
        last = parts.top(h, logits_to_keep=1)  # (B, 1, V)
        last3 = parts.top(h, logits_to_keep=3)
        trunk_out = parts.bottom(ids, logits_to_keep=1)  # no head: ignored
    assert last.shape == (2, 1, model.config.vocab_size)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(last3, full[:, -3:], atol=1e-6, rtol=1e-6)
    assert trunk_out.shape == h.shape
