"""splitlearn.server.engine.adapters: the bank (tenant-scoped keys, checkpoints), LoRA federation, the routes in-process."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import splitlearn as sl
from splitlearn.api import protocol as P
from splitlearn.errors import NotFound
from splitlearn.model.lora import LoraSpec
from splitlearn.server.engine.adapters import GLOBAL, AdapterBank, LoraFederation
from splitlearn.server.http.app import create_app
from splitlearn.server.config import ServerConfig
from splitlearn.api.wire import decode

from serverproc import TENANTS, OTHER, apply_step, assert_error, auth, post_tensors, same_weights, snapshot, tensors_of

SPEC = LoraSpec(r=2, alpha=4.0, targets=("c_attn", "c_fc"))


def _bank(optimizer="adamw"):
    from splitlearn.model.checkpoint import make_optimizer

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
    for i, cid in enumerate(["t1:a", "t2:b"]):
        _train(bank.replica(cid), i)
    assert bank.replica("t1:a").segment.adapter is not bank.replica("t2:b").segment.adapter
    assert same_weights(base, snapshot(trunk))
    sizes = bank.bytes_of("t1:a")
    n = sum(p.numel() for p in bank.replica("t1:a").segment.parameters())
    assert sizes == {"adapter": 4 * n, "optimizer": 2 * 4 * n + 4 * len(list(bank.replica("t1:a").segment.parameters()))}
    tensors, meta = bank.state()
    save_file(tensors, str(tmp_path / "a.safetensors"))  # what a checkpoint holds: safetensors + JSON
    _, fresh = _bank()
    fresh.restore(load_file(str(tmp_path / "a.safetensors")), json.loads(json.dumps(meta)))
    assert fresh.client_ids() == ["t1:a", "t2:b"]
    for cid in ("t1:a", "t2:b"):
        assert same_weights(bank.replica(cid).segment.state_dict(), fresh.replica(cid).segment.state_dict())
        # same optimizer state: one more identical step gives identical adapters
        _train(bank.replica(cid), 7, 1)
        _train(fresh.replica(cid), 7, 1)
        assert same_weights(bank.replica(cid).segment.state_dict(), fresh.replica(cid).segment.state_dict())


def test_a_client_id_is_scoped_to_its_tenant_and_seeded_by_the_id_alone():
    _, bank = _bank()
    with pytest.raises(NotFound, match="not trained"):
        bank.adapter_bytes("t1:a", "shared", trained=False)
    a1, a2 = bank.replica("t1:a"), bank.replica("t2:a")
    assert a1 is not a2 and a1.segment.adapter is not a2.segment.adapter  # two tenants, two clients
    # the initial adapter depends on the client's own id only (the client inits its side the same way)
    assert same_weights(a1.segment.adapter.tensors(), a2.segment.adapter.tensors())
    _train(a1, 0)
    assert not same_weights(a1.segment.adapter.tensors(), a2.segment.adapter.tensors())
    assert decode(bank.adapter_bytes("t2:a", "shared", trained=True))[0].keys() == a2.segment.adapter.tensors().keys()


def test_splitfed_averages_adapters_only_and_never_copies_the_base():
    trunk, bank = _bank("sgd")
    base = snapshot(trunk)
    from splitlearn.server.federation.strategy import make_strategy

    fed = LoraFederation(bank, "splitfed", 2, 60.0, strategy=make_strategy(max_share=None, max_update_ratio=None))  # weights 1:3, uncapped, unbounded
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
    cfg = ServerConfig(model="tiny", cuts=(1, 3), tokens=TENANTS, lora=SPEC, optimizer="sgd", lr=0.1)
    return create_app(cfg).test_client()


def test_routes_bind_adapters_to_tenants(app):
    info = app.get(P.INFO, headers=auth()).get_json()
    assert info["lora"] == SPEC.to_dict()
    h = torch.randn(1, 4, 32)
    meta = P.StepMeta("alice", 1).to_meta()
    tensors_of(post_tensors(app, P.TRAIN_FORWARD, {P.HIDDEN: h}, meta))
    tensors_of(post_tensors(app, P.TRAIN_BACKWARD, {P.GRAD: torch.ones(1, 4, 32)}, meta))
    assert apply_step(app, "alice", 1, lr=0.1).get_json()["lr"] == 0.1  # her own adapter: her lr
    # the other tenant has no "alice": her adapter, her sessions' adapter and her step are not its
    assert_error(app.get(P.CLIENT_ADAPTER.format(client_id="alice"), headers=auth(OTHER)), 404, "not trained")
    assert app.get(P.CLIENT_STATE.format(client_id="alice"), headers=auth(OTHER)).get_json()["step"] == 0
    r = app.get(P.CLIENT_ADAPTER.format(client_id="alice"), headers=auth())
    tensors, _ = decode(r.get_data())
    assert r.status_code == 200 and set(tensors) == {
        f"base_model.model.transformer.h.{i}.{m}.lora_{ab}.weight"
        for i in (1, 2) for m in ("attn.c_attn", "mlp.c_fc") for ab in "AB"}
    theirs = app.post(P.SESSIONS, data=json.dumps({"rows": 1, "client_id": "alice"}), headers=auth(OTHER))
    assert theirs.status_code == 201  # their own "alice" (no adapter yet): no squatting either way
    assert_error(app.post(P.SESSIONS, data=json.dumps({"rows": 1, "client_id": "bad id!"}), headers=auth()),
                 400, "client_id")
    r = app.post(P.SESSIONS, data=json.dumps({"rows": 1, "client_id": "alice"}), headers=auth())
    assert r.status_code == 201
    # evaluation with and without the adapter differ; the adapter is alice's, for alice's token only
    plain = tensors_of(post_tensors(app, P.FORWARD, {P.HIDDEN: h}, {}))[P.HIDDEN]
    mine = tensors_of(post_tensors(app, P.FORWARD, {P.HIDDEN: h}, {"client_id": "alice"}))[P.HIDDEN]
    assert not torch.allclose(plain, mine)
    # the other tenant's "alice" has no adapter: it evaluates on the base model, not on hers
    other = tensors_of(post_tensors(app, P.FORWARD, {P.HIDDEN: h}, {"client_id": "alice"}, token=OTHER))[P.HIDDEN]
    assert torch.equal(other, plain)
