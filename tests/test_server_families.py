"""A server of another family (docs/MODELS.md): ``--model DIR`` of a saved tiny Llama and Gemma 2,
U-shape and 2-way, through the app's test client. A training step (forward, backward, apply) and
a greedy decode through the server's segment equal the unsplit model."""
import copy

import pytest
import torch

import families as fam
from splitlearn import partition
from splitlearn.api import protocol as P
from splitlearn.model.segments import labels_from_batch
from splitlearn.server.config import ServerConfig
from splitlearn.server.http.app import create_app

from serverproc import TENANTS, TOKEN, apply_step, auth, post_tensors, segment_of, snapshot, tensors_of

LR = 0.05


@pytest.fixture(scope="module", params=["llama-gqa", "gemma2"])
def saved(request, tmp_path_factory):
    name = request.param
    d = tmp_path_factory.mktemp(name)
    fam.model(name).save_pretrained(d)
    return name, d


def app_of(d, cuts):
    return create_app(ServerConfig(model=str(d), cuts=cuts, tokens=TENANTS, optimizer="sgd", lr=LR))


def reference(d):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(d).eval()


def test_u_shape_training_step_equals_the_unsplit_step(saved):
    name, d = saved
    app = app_of(d, (1, 3))
    client = app.test_client()
    ref = reference(d)
    local = partition(copy.deepcopy(ref), (1, 3))
    ids, mask = fam.padded()
    labels = labels_from_batch(ids, mask)
    # the unsplit step, SGD at LR
    pos = local.bottom.arch.positions(mask, 0, ids.shape[1])
    loss_ref = ref(ids, attention_mask=mask, position_ids=pos, labels=labels).loss
    loss_ref.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= LR * p.grad
    # the split step: bottom here, trunk on the server, top here
    meta = P.StepMeta("c1", 1).to_meta()
    h = local.bottom(ids, mask)
    out = tensors_of(post_tensors(client, P.TRAIN_FORWARD, {P.HIDDEN: h.detach(), P.MASK: mask}, meta))[P.HIDDEN]
    out.requires_grad_()
    from splitlearn.model.segments import loss_from_logits
    loss = loss_from_logits(local.top(out, mask), labels)
    assert torch.equal(loss, loss_ref)
    loss.backward()
    grad_in = tensors_of(post_tensors(client, P.TRAIN_BACKWARD, {P.GRAD: out.grad}, meta))[P.GRAD]
    h.backward(grad_in)
    assert apply_step(client, "c1", 1, lr=LR).status_code == 200
    server = {k: v for k, v in segment_of(app).hf_state_dict().items()}
    expected = ref.state_dict()
    # the server's optimizer step: within 1e-6 (its apply path is its own code: guards, clip), as GPT-2's
    assert server and all(torch.allclose(v, expected[k], rtol=0, atol=1e-6) for k, v in server.items())
    for p_name, p in local.bottom.named_parameters():  # the client's gradients equal the unsplit ones
        hf = local.bottom.arch.hf_name(p_name, 0)
        assert torch.equal(p.grad, dict(ref.named_parameters())[hf].grad), hf


def test_two_way_greedy_decode_through_a_session_equals_generate(saved):
    name, d = saved
    app = app_of(d, (2,))
    client = app.test_client()
    ref = reference(d)
    ids, mask = fam.padded()
    steps = 5
    g = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                     do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=fam.PAD)
    bottom = partition(ref, (2,)).bottom
    cache = bottom.new_cache()
    r = client.post(P.SESSIONS, json={"rows": 2}, headers=auth(TOKEN))
    assert r.status_code == 201, r.get_data(as_text=True)
    sid = r.get_json()["session_id"]
    m, x, position, toks = mask, ids, 0, []
    with torch.no_grad():
        for s in range(steps):
            full = mask if s == 0 else torch.cat([mask, torch.ones(2, s, dtype=torch.long)], 1)
            h = bottom(x, full, cache)
            resp = post_tensors(client, P.SESSION_STEP.format(session_id=sid), {P.HIDDEN: h, P.MASK: m},
                                P.SessionStepMeta(position).to_meta())
            logits = tensors_of(resp)[P.LOGITS]  # (B, V), the last position's
            # the prefill bit for bit; decode steps run on the server's prepacked weights
            # (splitlearn/model/packed.py): within 1e-5, GPT-2's tolerance there
            assert torch.allclose(logits, g.logits[s], rtol=0, atol=1e-5), s
            x = logits.clone().index_fill_(-1, torch.tensor([2]), -float("inf")).argmax(-1, keepdim=True)
            toks.append(x)
            position += h.shape[1]
            m = torch.ones(2, 1, dtype=torch.long)
    assert torch.equal(torch.cat(toks, 1), g.sequences[:, ids.shape[1]:])


def test_info_names_the_family_and_its_kv_bytes(saved):
    name, d = saved
    app = app_of(d, (2,))
    info = app.test_client().get(P.INFO, headers=auth(TOKEN)).get_json()
    assert info["model_config"]["model_type"] == fam.config(name).model_type
    seg = segment_of(app)
    dims = app.extensions["splitlearn"].budget.dims
    assert dims.kv_token == sum(seg.arch.kv_bytes_per_token(4, 2, 4).values())  # float32, layers 2-3
    assert snapshot(seg)


def test_position_ids_on_the_wire_checked_and_used(saved):
    """A session step's optional position_ids: wrong shape, dtype or range is a 400 that changes
    nothing (the session's next step is still at position 0); the first segment's positions
    give the answer the mask's rule gives; other positions change a rotary family's answer."""
    from serverproc import assert_error
    name, d = saved
    app = app_of(d, (2,))
    client = app.test_client()
    ids, mask = fam.padded()
    bottom = partition(reference(d), (2,)).bottom
    with torch.no_grad():
        h = bottom(ids, mask)
    pos = bottom.arch.positions(mask, 0, ids.shape[1])

    def step(sid, extra):
        return post_tensors(client, P.SESSION_STEP.format(session_id=sid), {P.HIDDEN: h, P.MASK: mask, **extra},
                            P.SessionStepMeta(0).to_meta())

    def session():
        r = client.post(P.SESSIONS, json={"rows": 2}, headers=auth(TOKEN))
        return r.get_json()["session_id"]

    sid = session()
    assert_error(step(sid, {P.POSITIONS: pos[:, :-1]}), 400, "position_ids")
    assert_error(step(sid, {P.POSITIONS: pos.float()}), 400, "int64")
    assert_error(step(sid, {P.POSITIONS: pos + 1000}), 400, "outside")
    assert_error(step(sid, {P.POSITIONS: pos - 5}), 400, "outside")
    plain = tensors_of(step(sid, {}))[P.LOGITS]  # still at position 0: nothing changed
    same = tensors_of(step(session(), {P.POSITIONS: pos}))[P.LOGITS]
    assert torch.equal(plain, same)
    shifted = tensors_of(step(session(), {P.POSITIONS: pos + 3}))[P.LOGITS]
    assert not torch.allclose(shifted, plain)


@pytest.mark.parametrize("name", [n for n in fam.NAMES if n not in ("llama-gqa", "gemma2", "gpt2")])
def test_every_family_trains_and_decodes_through_a_server(name, tmp_path):
    """The other families, lighter: a U-shape piece (the loss and the client's gradients bit for
    bit) and a 2-way prefill and two decode steps (logits as generate()'s: the prefill bit for
    bit, decode within 1e-5)."""
    fam.model(name).save_pretrained(tmp_path)
    ref = reference(tmp_path)
    ids, mask = fam.padded()
    labels = labels_from_batch(ids, mask)
    local = partition(copy.deepcopy(ref), (1, 3))
    pos = local.bottom.arch.positions(mask, 0, ids.shape[1])
    want = ref(ids, attention_mask=mask, position_ids=pos, labels=labels)
    want.loss.backward()
    client = app_of(tmp_path, (1, 3)).test_client()
    meta = P.StepMeta("c1", 1).to_meta()
    h = local.bottom(ids, mask)
    out = tensors_of(post_tensors(client, P.TRAIN_FORWARD, {P.HIDDEN: h.detach(), P.MASK: mask}, meta))[P.HIDDEN]
    out.requires_grad_()
    from splitlearn.model.segments import loss_from_logits
    loss = loss_from_logits(local.top(out, mask), labels)
    assert torch.equal(loss, want.loss)
    loss.backward()
    h.backward(tensors_of(post_tensors(client, P.TRAIN_BACKWARD, {P.GRAD: out.grad}, meta))[P.GRAD])
    grads = dict(ref.named_parameters())
    for p_name, p in local.bottom.named_parameters():
        assert torch.equal(p.grad, grads[local.bottom.arch.hf_name(p_name, 0)].grad), p_name
    # 2-way decode
    g = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                     output_logits=True, return_dict_in_generate=True, pad_token_id=fam.PAD)
    client = app_of(tmp_path, (2,)).test_client()
    bottom = partition(ref, (2,)).bottom
    cache = bottom.new_cache()
    sid = client.post(P.SESSIONS, json={"rows": 2}, headers=auth(TOKEN)).get_json()["session_id"]
    x, m, full, position = ids, mask, mask, 0
    with torch.no_grad():
        for s in range(3):
            hb = bottom(x, full, cache)
            logits = tensors_of(post_tensors(client, P.SESSION_STEP.format(session_id=sid), {P.HIDDEN: hb, P.MASK: m},
                                             P.SessionStepMeta(position).to_meta()))[P.LOGITS]
            if s == 0:
                assert torch.equal(logits, g.logits[0])
            assert torch.allclose(logits, g.logits[s], rtol=0, atol=1e-5), s
            x = g.sequences[:, ids.shape[1] + s:ids.shape[1] + s + 1]  # generate()'s token
            position += hb.shape[1]
            m = torch.ones(2, 1, dtype=torch.long)
            full = torch.cat([full, m], 1)
