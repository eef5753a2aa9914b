"""A client's learning rate rules only state that is the client's own (issue 29, item 1).

The attack: a tenant opens a step (open-ended, ``micros=0``), sends one forward and backward,
and applies it with ``"lr": 10``. In ``shared`` and ``sequential`` modes the segment is every
tenant's, so the server steps it at most at its own ``--lr``: another owner's evaluation is
bit-identical to the one after the same step applied honestly at the server's lr. On a
client's own state (its SplitFed copy, its LoRA adapter) the client's lr is applied as sent.
"""
import pytest
import requests
import torch

from splitlearn.api import protocol as P
from splitlearn.model.lora import LoraSpec
from splitlearn.server.http.app import create_app
from splitlearn.server.config import ServerConfig
from splitlearn.api.wire import decode, encode

from serverproc import OTHER, TENANTS, TOKEN, InprocServerProcess, auth, web

pytestmark = pytest.mark.slow

SERVER_LR = 1e-2  # InprocServerProcess's --lr (AdamW: a first step moves each weight by about this)
ATTACK_LR = P.MAX_LR  # the largest lr the protocol takes


def hidden(seed: int, rows: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randn(rows, length, 32, generator=torch.Generator().manual_seed(seed))  # tiny: n_embd 32


def post(session, url: str, path: str, tensors: dict, meta: dict):
    return session.post(url + path, data=encode(tensors, meta), timeout=30,
                        headers={"Content-Type": P.CONTENT_TYPE})


def open_ended_step(session, url: str, lr: float, fed_version=None) -> dict:
    """Mallory's step 1 of client "m": one forward, one backward, applied at ``lr``."""
    meta = P.StepMeta("m", 1, fed_version=fed_version).to_meta()
    r = post(session, url, P.TRAIN_FORWARD, {P.HIDDEN: hidden(1)}, meta)
    assert r.status_code == 200, r.text
    r = post(session, url, P.TRAIN_BACKWARD, {P.GRAD: hidden(2)}, meta)
    assert r.status_code == 200, r.text
    r = session.post(url + P.TRAIN_APPLY, json={"client_id": "m", "step": 1, "pieces": 1, "lr": lr}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def evaluation(url: str) -> torch.Tensor:
    """Alice's evaluation of fixed activations (what the victim sees of the shared segment)."""
    r = web.post(url + P.FORWARD, data=encode({P.HIDDEN: hidden(3)}), timeout=30,
                 headers={**auth(TOKEN), "Content-Type": P.CONTENT_TYPE})
    assert r.status_code == 200, r.text
    return decode(r.content)[0][P.HIDDEN]


def mallory() -> requests.Session:
    s = web.Session()
    s.headers.update(auth(OTHER))
    return s


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("\n".join(TENANTS) + "\n")
    return str(path)


def test_a_tenants_lr_10_moves_the_shared_segment_as_an_honest_step_at_the_servers_lr(token_file):
    """shared mode (the default): two identical servers, the same step from mallory at lr 10 on
    one and at the server's lr on the other; alice's evaluations are bit-identical, and differ
    from before (the step was applied)."""
    servers = [InprocServerProcess((1, 3), lr=SERVER_LR, extra=["--token-file", token_file]) for _ in range(2)]
    with servers[0] as attacked, servers[1] as honest:
        before = evaluation(attacked.url)
        assert torch.equal(before, evaluation(honest.url))  # the same seed: the same segment
        answer = open_ended_step(mallory(), attacked.url, ATTACK_LR)
        assert answer["applied"] and answer["lr"] == SERVER_LR  # the lr applied, not the one asked
        assert open_ended_step(mallory(), honest.url, SERVER_LR)["lr"] == SERVER_LR
        after = evaluation(attacked.url)
        assert torch.equal(after, evaluation(honest.url))
        assert not torch.equal(after, before)
        # a lower lr is the client's to choose (schedules decay), on the shared segment too
        s = mallory()
        meta = P.StepMeta("m", 2).to_meta()
        assert post(s, attacked.url, P.TRAIN_FORWARD, {P.HIDDEN: hidden(4)}, meta).status_code == 200
        assert post(s, attacked.url, P.TRAIN_BACKWARD, {P.GRAD: hidden(5)}, meta).status_code == 200
        r = s.post(attacked.url + P.TRAIN_APPLY, json={"client_id": "m", "step": 2, "pieces": 1, "lr": 1e-3},
                   timeout=30)
        assert r.status_code == 200 and r.json()["lr"] == 1e-3, r.json()


def test_the_turn_holders_lr_cannot_pass_the_servers_on_the_sequential_segment(tmp_path, token_file):
    """sequential mode: every weight moves by at most the server's lr (one AdamW step), not by 10."""
    with InprocServerProcess((1, 3), lr=SERVER_LR, checkpoint_dir=tmp_path / "ckpt",
                             extra=["--federation", "sequential", "--token-file", token_file]) as srv:
        before = srv.weights()
        s = mallory()
        assert s.post(srv.url + P.FEDERATION_TURN, json={"client_id": "m"}, timeout=30).status_code == 200
        assert open_ended_step(s, srv.url, ATTACK_LR, fed_version=0)["lr"] == SERVER_LR
        after = srv.weights()
        moved = max(float((after[k] - before[k]).abs().max()) for k in before)
        assert 0 < moved <= SERVER_LR * 1.001, moved


def in_process(**kw):
    cfg = ServerConfig(model="tiny", cuts=(1, 3), lr=SERVER_LR, tokens=TENANTS, allow_weak_tokens=True, **kw)
    return create_app(cfg).test_client()


@pytest.mark.parametrize("kw", [{"federation": "splitfed"}, {"lora": LoraSpec(2, 4.0, "c_attn", 0.0)}],
                         ids=["splitfed-copy", "lora-adapter"])
def test_on_its_own_copy_or_adapter_the_clients_lr_is_applied_as_sent(kw):
    client = in_process(**kw)
    version = 0 if "federation" in kw else None
    meta = P.StepMeta("m", 1, fed_version=version).to_meta()
    headers = {**auth(OTHER), "Content-Type": P.CONTENT_TYPE}
    for path, t in ((P.TRAIN_FORWARD, {P.HIDDEN: hidden(1)}), (P.TRAIN_BACKWARD, {P.GRAD: hidden(2)})):
        r = client.post(path, data=encode(t, meta), headers=headers)
        assert r.status_code == 200, r.get_data(as_text=True)
    r = client.post(P.TRAIN_APPLY, json={"client_id": "m", "step": 1, "pieces": 1, "lr": 0.5}, headers=auth(OTHER))
    assert r.status_code == 200 and r.get_json()["lr"] == 0.5


def test_a_model_class_client_above_the_servers_lr_is_told_once(caplog):
    """An honest client whose schedule peaks above the server's --lr is not silently slowed: the
    answer says which lr was applied, and the model warns once."""
    from splitlearn import SplitGPT2LMHeadModel

    with InprocServerProcess((1, 3), lr=SERVER_LR) as srv:
        model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN).train()
        opt = torch.optim.SGD(model.parameters(), lr=10 * SERVER_LR)
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        with caplog.at_level("WARNING", logger="splitlearn.hf.applies"):
            for _ in range(2):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
        assert model.remote.last_apply["lr"] == SERVER_LR
        warned = [r for r in caplog.records if "applied lr" in r.getMessage()]
        assert len(warned) == 1 and "--lr" in warned[0].getMessage()
        model.remote.close()
