"""Training state on disk: weights + optimizer state + counters, restored exactly, never unpickled."""
import json

import pytest
import torch

from splitlearn import partition
from splitlearn.model.checkpoint import (has_state, latest, load_state, make_optimizer, read_extra, save_state,
                                   unique_parameters)
from splitlearn.errors import ConfigError, SegmentFileError
from splitlearn.model.loading import load_model
from splitlearn.model.segments import labels_from_batch, loss_from_logits


def trained_parts(steps: int, optimizer: str = "adamw"):
    model = load_model("tiny")
    parts = partition(model, (1, 3))
    segs = [parts.bottom, parts.top]
    opt = make_optimizer(unique_parameters(segs), optimizer, 1e-2)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        opt.zero_grad()
        loss_from_logits(parts(ids), labels_from_batch(ids, None)).backward()
        opt.step()
    return parts, segs, opt, ids


def test_make_optimizer():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(make_optimizer(p, "adamw", 0.1), torch.optim.AdamW)
    assert isinstance(make_optimizer(p, "sgd", 0.1), torch.optim.SGD)
    with pytest.raises(ConfigError, match="unknown optimizer 'adam'"):
        make_optimizer(p, "adam", 0.1)


def test_unique_parameters_counts_the_tied_weight_once():
    parts = partition(load_model("tiny"), (1, 3))
    params = unique_parameters([parts.bottom, parts.top])
    assert len({id(p) for p in params}) == len(params)
    assert parts.bottom.wte.weight is parts.top.lm_head.weight
    assert sum(p is parts.bottom.wte.weight for p in params) == 1


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_save_then_load_continues_exactly(tmp_path, optimizer):
    parts, segs, opt, ids = trained_parts(2, optimizer)
    save_state(tmp_path, "client", segs, opt, {"step": 2})
    assert has_state(tmp_path, "client") and not has_state(tmp_path, "server")
    assert json.loads((latest(tmp_path, "client") / "state.json").read_text())["counters"] == {"step": 2}
    opt.zero_grad()
    loss_from_logits(parts(ids), labels_from_batch(ids, None)).backward()
    opt.step()
    expected = parts(ids).detach()

    parts2, segs2, opt2, _ = trained_parts(0, optimizer)
    assert load_state(tmp_path, "client", segs2, opt2) == {"step": 2}
    opt2.zero_grad()
    loss_from_logits(parts2(ids), labels_from_batch(ids, None)).backward()
    opt2.step()
    assert torch.equal(parts2(ids).detach(), expected)


def test_load_refuses_other_segments_and_missing_weights(tmp_path):
    _, segs, opt, _ = trained_parts(1)
    save_state(tmp_path, "client", segs, opt, {})
    _, other, other_opt, _ = trained_parts(0)
    with pytest.raises(SegmentFileError, match="holds segments"):
        load_state(tmp_path, "client", other[:1], other_opt)
    save_state(tmp_path / "partial", "client", segs[:1], opt, {})  # holds the bottom only
    with pytest.raises(SegmentFileError, match="holds segments"):
        load_state(tmp_path / "partial", "client", other, other_opt)


def test_generations_are_atomic_and_a_crash_mid_save_leaves_the_last_one(tmp_path):
    _, segs, opt, _ = trained_parts(1)
    first = save_state(tmp_path, "server", segs, opt, {"n": 1})
    second = save_state(tmp_path, "server", segs, opt, {"n": 2}, extra={"fed": {"w": torch.ones(2)}})
    assert latest(tmp_path, "server") == second and first.is_dir()  # the previous one is kept
    assert torch.equal(read_extra(tmp_path, "server", "fed")["w"], torch.ones(2))
    assert read_extra(tmp_path, "server", "absent") is None
    # a save killed half-way: its .tmp directory holds some files, the pointer is untouched
    crashed = tmp_path / "server-00000003.tmp"
    crashed.mkdir()
    (crashed / "weights.safetensors").write_bytes(b"\x00" * 10)
    _, fresh, fresh_opt, _ = trained_parts(0)
    assert load_state(tmp_path, "server", fresh, fresh_opt) == {"n": 2}
    third = save_state(tmp_path, "server", segs, opt, {"n": 3})
    assert not crashed.exists() and not first.exists() and latest(tmp_path, "server") == third


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "state"])
def test_a_corrupt_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    _, segs, opt, _ = trained_parts(1)
    gen = save_state(tmp_path, "server", segs, opt, {"n": 1})
    target = gen / ("state.json" if damage == "state" else "optim.safetensors")
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "delete":
        target.unlink()
    else:
        target.write_text('{"files": ')
    _, fresh, fresh_opt, _ = trained_parts(0)
    with pytest.raises(SegmentFileError, match=str(target)):
        load_state(tmp_path, "server", fresh, fresh_opt)


def test_checkpoints_and_journals_are_readable_by_their_owner_only(tmp_path):
    """Files 0600, every directory made 0700, whatever the umask (here 0: everything open)."""
    import os
    import stat

    from splitlearn.hf.journal import RequestLog, Sent, read_log

    def mode(p):
        return stat.S_IMODE(p.stat().st_mode)

    _, segs, opt, ids = trained_parts(1)
    top = tmp_path / "made" / "ckpt"
    old = os.umask(0)
    try:
        for _ in range(2):  # a second generation, and a file that existed is rewritten 0600
            gen = save_state(top, "client", segs, opt, {"n": 1})
        journal = RequestLog(True, top)
        journal.note(2, {"ids": ids, "rng": torch.get_rng_state()})
        journal.record(2, Sent("/v1/train/forward", {"hidden": torch.ones(2)}, {"step": "2"}), {"hidden": torch.ones(2)})
    finally:
        os.umask(old)
    assert [mode(d) for d in (tmp_path / "made", top, gen, top / "wal")] == [0o700] * 4
    files = [p for p in top.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"client.latest", "weights.safetensors", "state.json",
                                       "0000000002-00000001.safetensors", "0000000002-00000002.safetensors"}
    assert {p.name: mode(p) for p in files} == {p.name: 0o600 for p in files}
    records = read_log(top, 1)
    assert [r.step for r in records] == [2, 2] and torch.equal(records[0].sent.tensors["ids"], ids)
    assert torch.equal(records[1].answer["hidden"], torch.ones(2)) and records[1].sent.meta == {"step": "2"}
    _, fresh, fresh_opt, _ = trained_parts(0)
    assert load_state(top, "client", fresh, fresh_opt) == {"n": 1}
