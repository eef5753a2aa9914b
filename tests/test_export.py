"""export_segments -> load_segment / load_segments: the loaded split still equals the whole,
and a file that does not match its spec is refused before any weight is used."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import all_cuts, hf_forward
from test_generation import assert_same_choices
from splitlearn import SegmentFileError, export_segments, load_segment, load_segments, partition
from splitlearn.model.export import _sha256
from splitlearn.model.segments import labels_from_batch, loss_from_logits

ATOL = 1e-5


def kinds_of(cuts):
    return ["bottom", "top"] if len(cuts) == 1 else ["bottom", "trunk", "top"]


def chain(segments, ids, mask, caches=None):
    x = ids
    for i, seg in enumerate(segments):
        x = seg(x, mask, caches[i] if caches else None)
    return x


def hf_params(seg):
    """{Hugging Face name: parameter} of a segment (the parameters themselves, not copies)."""
    return {hf: p for (_, p), hf in zip(seg.named_parameters(), seg.hf_state_dict())}


@pytest.fixture
def exported(tiny_model, tmp_path):
    export_segments(tiny_model, (1, 3), tmp_path)
    return tmp_path


# -- what is written ---------------------------------------------------------------------

def test_export_writes_weights_and_spec_per_segment(tiny_model, tmp_path):
    paths = export_segments(tiny_model, (1, 3), tmp_path)
    assert [p.name for p in paths] == ["bottom.json", "trunk.json", "top.json"]
    spec = json.loads((tmp_path / "top.json").read_text())
    assert spec["format"] == "splitlearn-segment" and spec["version"] == 1
    assert (spec["kind"], spec["blocks"], spec["cuts"]) == ("top", [3, 4], [1, 3])
    assert spec["tied_lm_head"] == "copy" and spec["dtype"] == "float32"
    assert spec["sha256"] == _sha256(tmp_path / "top.safetensors")
    assert spec["tensors"]["lm_head.weight"]["shape"] == [257, 32]
    trunk = load_file(str(tmp_path / "trunk.safetensors"))
    assert all(k.startswith(("transformer.h.1.", "transformer.h.2.")) for k in trunk)


def test_export_accepts_a_partition(tiny_model, tmp_path):
    export_segments(partition(tiny_model, 2), out_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bottom.json", "bottom.safetensors", "top.json", "top.safetensors"]


# -- round trips -------------------------------------------------------------------------

@pytest.mark.parametrize("cuts", all_cuts())
def test_loaded_segments_equal_the_unsplit_model(tiny_model, padded_batch, tmp_path, cuts):
    ids, mask = padded_batch
    export_segments(tiny_model, cuts, tmp_path)
    segs = load_segments(tmp_path, kinds_of(cuts))
    assert [s.blocks for s in segs] == [s.blocks for s in partition(tiny_model, cuts)]
    with torch.no_grad():
        logits = chain(segs, ids, mask)
        ref = hf_forward(tiny_model, ids, mask).logits
    torch.testing.assert_close(logits, ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize("cuts", [(0,), (2,), (4,), (1, 3), (0, 4)])
def test_loaded_bottom_and_top_are_retied_and_gradients_match(tiny_model, padded_batch, tmp_path, cuts):
    ids, mask = padded_batch
    export_segments(tiny_model, cuts, tmp_path)
    segs = load_segments(tmp_path, kinds_of(cuts))
    assert segs[-1].lm_head.weight is segs[0].wte.weight
    labels = labels_from_batch(ids, mask)
    ref = hf_forward(tiny_model, ids, mask, labels=labels)
    names = [n for n, _ in tiny_model.named_parameters()]  # wte once: lm_head is tied to it
    ref_grads = torch.autograd.grad(ref.loss, list(tiny_model.parameters()))
    loaded = {k: p for s in segs for k, p in hf_params(s).items()}
    loss = loss_from_logits(chain(segs, ids, mask), labels)
    grads = torch.autograd.grad(loss, [loaded[n] for n in names])
    torch.testing.assert_close(loss, ref.loss, rtol=0, atol=ATOL)
    for name, g, r in zip(names, grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_a_lone_top_keeps_its_own_copy(tiny_model, padded_batch, exported):
    (exported / "bottom.safetensors").unlink()  # a server has only its own files
    (exported / "bottom.json").unlink()
    top = load_segment(exported / "top")
    assert top.lm_head.weight.data_ptr() != tiny_model.transformer.wte.weight.data_ptr()
    torch.testing.assert_close(top.lm_head.weight, tiny_model.transformer.wte.weight, rtol=0, atol=0)
    ids, mask = padded_batch
    with torch.no_grad():
        h = partition(tiny_model, (1, 3))[:2]
        x = chain(h, ids, mask)
        torch.testing.assert_close(top(x, mask), hf_forward(tiny_model, ids, mask).logits,
                                   rtol=0, atol=ATOL)


def test_loaded_segments_do_not_share_memory_with_the_model(tiny_model, exported):
    ptrs = {p.data_ptr() for p in tiny_model.parameters()}
    for seg in load_segments(exported, ["bottom", "trunk", "top"]):
        assert not any(p.data_ptr() in ptrs for p in seg.parameters())
        assert not seg.training


def test_load_segment_by_either_file_name(exported):
    for path in (exported / "trunk", exported / "trunk.json", exported / "trunk.safetensors"):
        assert load_segment(path).blocks == (1, 3)


def test_load_segment_casts_dtype(exported):
    seg = load_segment(exported / "trunk", dtype="bfloat16", device="cpu")
    assert {p.dtype for p in seg.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in seg.parameters()} == {"cpu"}


@pytest.mark.parametrize("cuts", [(0,), (4,), (1, 3)])
def test_cached_generation_through_loaded_segments(tiny_model, padded_batch, tmp_path, cuts):
    ids, mask = padded_batch
    export_segments(tiny_model, cuts, tmp_path)
    segs = load_segments(tmp_path, kinds_of(cuts))
    eos = tiny_model.config.eos_token_id
    ref = tiny_model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)
    assert_same_choices(segs, ids, mask, ref, eos)  # step by step, each segment with its cache


# -- files that do not match their spec --------------------------------------------------

def rewrite_spec(path, edit):
    spec = json.loads(path.read_text())
    edit(spec)
    path.write_text(json.dumps(spec))


def test_tampered_bytes_are_refused(exported):
    weights = exported / "trunk.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one bit pattern in the last weight
    weights.write_bytes(bytes(data))
    with pytest.raises(SegmentFileError, match="sha256"):
        load_segment(exported / "trunk")


def test_wrong_shape_in_spec_is_refused(exported):
    name = "transformer.h.1.mlp.c_fc.weight"
    rewrite_spec(exported / "trunk.json", lambda s: s["tensors"][name].update(shape=[32, 64]))
    with pytest.raises(SegmentFileError, match=f"{name} has shape"):
        load_segment(exported / "trunk")


def test_wrong_shape_in_weights_with_recomputed_hash_is_refused(exported):
    weights = exported / "trunk.safetensors"
    tensors = load_file(str(weights))
    name = "transformer.h.2.attn.c_proj.weight"
    tensors[name] = torch.zeros(16, 32)
    save_file(tensors, str(weights))
    rewrite_spec(exported / "trunk.json", lambda s: s.update(sha256=_sha256(weights)))
    with pytest.raises(SegmentFileError, match=name):
        load_segment(exported / "trunk")


def test_config_that_does_not_fit_the_weights_is_refused(exported):
    rewrite_spec(exported / "trunk.json", lambda s: s["config"].update(n_embd=64))
    with pytest.raises(SegmentFileError, match="the config needs"):
        load_segment(exported / "trunk")


def test_missing_and_extra_tensors_are_refused(exported):
    weights = exported / "top.safetensors"
    tensors = load_file(str(weights))
    tensors.pop("lm_head.weight")
    tensors["transformer.h.0.ln_1.weight"] = torch.ones(32)
    save_file(tensors, str(weights))
    rewrite_spec(exported / "top.json", lambda s: s.update(sha256=_sha256(weights)))
    with pytest.raises(SegmentFileError, match=r"missing tensors \['lm_head.weight'\]"):
        load_segment(exported / "top")


def test_missing_weights_file_is_refused(exported):
    (exported / "trunk.safetensors").unlink()
    with pytest.raises(SegmentFileError, match="missing"):
        load_segment(exported / "trunk")


def test_missing_or_foreign_spec_is_refused(exported):
    with pytest.raises(SegmentFileError, match="no segment spec"):
        load_segment(exported / "nothing")
    (exported / "trunk.json").write_text("{not json")
    with pytest.raises(SegmentFileError, match="not valid JSON"):
        load_segment(exported / "trunk")
    (exported / "top.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(SegmentFileError, match="splitlearn-segment v1"):
        load_segment(exported / "top")


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("sha256"), r"lacks the fields \['sha256'\]"),
    (lambda s: s.pop("blocks"), "lacks the fields"),
    (lambda s: s.update(kind="middle"), "unknown segment kind 'middle'"),
])
def test_incomplete_spec_is_refused(exported, edit, message):
    rewrite_spec(exported / "trunk.json", edit)
    with pytest.raises(SegmentFileError, match=message):
        load_segment(exported / "trunk")
