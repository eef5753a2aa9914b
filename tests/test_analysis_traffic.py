"""Bytes per wire dtype, KV cache bytes, tied weights."""
from splitlearn import partition
from splitlearn.analysis.traffic import cut_traffic, kv_cache_bytes, tied_parameters, wire_bytes


def test_wire_bytes_int8_has_a_scale_per_row():
    assert wire_bytes(2, 3, 768) == {"float32": 2 * 3 * 768 * 4, "bfloat16": 2 * 3 * 768 * 2,
                                     "float16": 2 * 3 * 768 * 2, "int8": 2 * 3 * 768 + 2 * 3 * 4}


def test_cuts_kv_and_ties(tiny_model):
    part = partition(tiny_model, (0, 4))  # bottom of embeddings only, top of the head only
    cuts = cut_traffic(part, 1, 5, "train")
    assert [(c["block"], c["from"], c["to"]) for c in cuts] == [(0, "bottom", "trunk"), (4, "trunk", "top")]
    assert cuts[1]["gradients_bytes"] == cuts[1]["activations_bytes"]
    bottom, trunk, top = part.segments
    assert kv_cache_bytes(bottom, 1, 5) == 0 and kv_cache_bytes(trunk, 1, 5) == 2 * 4 * 5 * 32 * 4
    assert len(tied_parameters(part)) == 1
