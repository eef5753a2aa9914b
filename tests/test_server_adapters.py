"""splitlearn.server.adapters: the bank (owners, checkpoints), LoRA federation, the routes in-process."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import splitlearn as sl
from splitlearn import protocol as P
from splitlearn.errors import NotFound
from splitlearn.lora import LoraSpec
from splitlearn.server.adapters import GLOBAL, AdapterBank, LoraFederation
from splitlearn.server.app import create_app
from splitlearn.server.config import ServerConfig
from splitlearn.wire import decode

from serverproc import OTHER, TOKEN, assert_error, auth, post_tensors, same_weights, snapshot, tensors_of

SPEC = LoraSpec(r=2, alpha=4.0, targets=("c_attn", "c_fc"))


def _bank(optimizer="adamw"):
    from splitlearn.checkpoint import make_optimizer

    trunk = sl.partition(sl.load_model("tiny"), (1, 3)).trunk
    return trunk, AdapterBank(trunk, SPEC, 0, lambda ps: make_optimizer(ps, optimizer, 1e-2))


def _train(rep, seed, steps=2):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rep.optimizer.zero_grad()
        rep.segment.train()
        rep.segment(torch.randn(2, 5, 32, generator=g)).pow(2).mean().backward()
        rep.optimizer.step()


def test_each_client_gets_its_own_adapter_and_a_checkpoint_restores_them_all(tmp_path):
    trunk, bank = _bank()
    base = snapshot(trunk)
    for i, cid in enumerate(["a", "b"]):
        bank.claim(cid, f"owner-{cid}")
        _train(bank.replica(cid), i)
    assert bank.replica("a").segment.adapter is not bank.replica("b").segment.adapter
    assert same_weights(base, snapshot(trunk))
    sizes = bank.bytes_of("a")
    n = sum(p.numel() for p in bank.replica("a").segment.parameters())
    assert sizes == {"adapter": 4 * n, "optimizer": 2 * 4 * n + 4 * len(list(bank.replica("a").segment.parameters()))}
    tensors, meta = bank.state()
    save_file(tensors, str(tmp_path / "a.safetensors"))  # what a checkpoint holds: safetensors + JSON
    _, fresh = _bank()
    fresh.restore(load_file(str(tmp_path / "a.safetensors")), json.loads(json.dumps(meta)))
    assert fresh.owners == {"a": "owner-a", "b": "owner-b"}
    for cid in ("a", "b"):
        assert same_weights(bank.replica(cid).segment.state_dict(), fresh.replica(cid).segment.state_dict())
        # same optimizer state: one more identical step gives identical adapters
        _train(bank.replica(cid), 7, 1)
        _train(fresh.replica(cid), 7, 1)
        assert same_weights(bank.replica(cid).segment.state_dict(), fresh.replica(cid).segment.state_dict())


def test_a_client_id_belongs_to_the_first_token_that_uses_it():
    _, bank = _bank()
    bank.claim("a", "t1")
    bank.claim("a", "t1")
    with pytest.raises(NotFound):
        bank.claim("a", "t2")
    with pytest.raises(NotFound):
        bank.check_reader("a", "t2")
    with pytest.raises(NotFound, match="not trained"):
        bank.adapter_bytes("a", "t1", "shared")


def test_splitfed_averages_adapters_only_and_never_copies_the_base():
    trunk, bank = _bank("sgd")
    base = snapshot(trunk)
    fed = LoraFederation(bank, "splitfed", 2, 60.0)
    reps = [fed.replica_for(c, 0) for c in ("a", "b")]
    assert all(r.segment.base is trunk for r in reps)
    assert all(set(r.segment.state_dict()) == set(fed.base.segment.state_dict()) for r in reps)
    for i, r in enumerate(reps):
        _train(r, i)
    want = {k: (reps[0].segment.state_dict()[k] * 1 + reps[1].segment.state_dict()[k] * 3) / 4
            for k in reps[0].segment.state_dict()}
    fed.sync("a", {"w": torch.ones(1)}, 1)
    fed.sync("b", {"w": torch.ones(1) * 5}, 3)
    assert fed.version == 1
    got = bank.replicas[GLOBAL].segment.state_dict()
    assert all(torch.allclose(got[k], want[k], atol=1e-7) for k in want)
    assert same_weights(base, snapshot(trunk))
    assert torch.equal(fed.client_weights["w"], torch.tensor([4.0]))


@pytest.fixture(scope="module")
def app():
    cfg = ServerConfig(model="tiny", cuts=(1, 3), tokens=(TOKEN, OTHER), lora=SPEC, optimizer="sgd", lr=0.1)
    return create_app(cfg).test_client()


def test_routes_bind_adapters_to_tokens(app):
    info = app.get(P.INFO, headers=auth()).get_json()
    assert info["lora"] == SPEC.to_dict()
    h = torch.randn(1, 4, 32)
    meta = P.StepMeta("alice", 1).to_meta()
    tensors_of(post_tensors(app, P.TRAIN_FORWARD, {P.HIDDEN: h}, meta))
    assert_error(post_tensors(app, P.TRAIN_FORWARD, {P.HIDDEN: h}, P.StepMeta("alice", 1).to_meta(), token=OTHER),
                 404, "no client")
    tensors_of(post_tensors(app, P.TRAIN_BACKWARD, {P.GRAD: torch.ones(1, 4, 32)}, meta))
    r = app.get(P.CLIENT_ADAPTER.format(client_id="alice"), headers=auth())
    tensors, _ = decode(r.get_data())
    assert r.status_code == 200 and set(tensors) == {
        f"base_model.model.transformer.h.{i}.{m}.lora_{ab}.weight"
        for i in (1, 2) for m in ("attn.c_attn", "mlp.c_fc") for ab in "AB"}
    assert_error(app.get(P.CLIENT_ADAPTER.format(client_id="alice"), headers=auth(OTHER)), 404, "no client")
    assert_error(app.post(P.SESSIONS, data=json.dumps({"rows": 1, "client_id": "alice"}), headers=auth(OTHER)),
                 404, "no client")
    assert_error(app.post(P.SESSIONS, data=json.dumps({"rows": 1, "client_id": "bad id!"}), headers=auth()),
                 400, "client_id")
    r = app.post(P.SESSIONS, data=json.dumps({"rows": 1, "client_id": "alice"}), headers=auth())
    assert r.status_code == 201
    # evaluation with and without the adapter differ; the adapter is alice's, for alice's token only
    plain = tensors_of(post_tensors(app, P.FORWARD, {P.HIDDEN: h}, {}))[P.HIDDEN]
    mine = tensors_of(post_tensors(app, P.FORWARD, {P.HIDDEN: h}, {"client_id": "alice"}))[P.HIDDEN]
    assert not torch.allclose(plain, mine)
    assert_error(post_tensors(app, P.FORWARD, {P.HIDDEN: h}, {"client_id": "alice"}, token=OTHER), 404, "no client")
