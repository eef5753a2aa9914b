"""``position_ids`` on the training routes (``/v1/train/forward``, ``/v1/train/step``,
``/v1/forward``), docs/MODELS.md and docs/PROTOCOL.md: optional (absent: the server derives them
from the mask; a split model sends its own where they differ, tests/test_hf_family_positions.py);
a tensor of the wrong shape, dtype or range is a 400 that changes nothing; given, the server's
layers use them. End to end: packed sequences (two
sequences per row, positions restarting, no mask) through ``AutoSplitModelForCausalLM`` give the
unsplit model's loss and gradients, U-shape and 2-way, on a tiny Llama (GQA) and Gemma 2.

The attack: a server that ignored the client's positions (or a client that did not send them)
would rotate the server's layers by the mask's positions and mask across the packed sequences'
boundary: the loss would be the unpacked one, which differs (checked)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn import AutoSplitModelForCausalLM, partition
from splitlearn.api import protocol as P

from serverproc import TENANTS, TOKEN, InprocServerProcess, assert_error, auth, post_tensors, tensors_of
from test_server_families import app_of

NAMES = ["llama-gqa", "gemma2"]


@pytest.fixture(scope="module", params=NAMES)
def saved(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    fam.model(request.param).save_pretrained(d)
    return request.param, d


def packed(rows=2, length=10):
    """(input_ids, position_ids): each row two sequences packed, positions restarting at 0."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, fam.V, (rows, length), generator=g)
    pos = torch.stack([torch.cat([torch.arange(k), torch.arange(length - k)]) for k in (6, 3)[:rows]])
    return ids, pos


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_the_training_routes_check_and_use_position_ids(saved, cuts):
    name, d = saved
    app = app_of(d, cuts)
    client = app.test_client()
    ids, pos = packed()
    ref = AutoModelForCausalLM.from_pretrained(d).eval()
    bottom = partition(ref, cuts).bottom
    with torch.no_grad():
        h = bottom(ids, None, position_ids=pos)  # (2, 10, d): what a client sends
    two_way = len(cuts) == 1
    path = P.TRAIN_STEP if two_way else P.TRAIN_FORWARD
    body = {P.HIDDEN: h, **({P.LABELS: ids} if two_way else {})}
    m = P.StepMeta("c", 1).to_meta()  # step 1, piece 0 (2-way: a fused piece, loss_scale 1)
    for bad, words in [(pos[:, :-1], "position_ids"), (pos.float(), "int64"), (pos[None], "position_ids"),
                       (pos + 1000, "outside"), (pos - 1, "outside")]:
        assert_error(post_tensors(client, path, {**body, P.POSITIONS: bad}, m), 400, words)
        assert_error(post_tensors(client, P.FORWARD, {P.HIDDEN: h, P.POSITIONS: bad}, {"padding": "any"}), 400,
                     words)
    state = client.get(P.CLIENT_STATE.format(client_id="c"), headers=auth(TOKEN)).get_json()
    assert state["step"] == 0  # nothing changed: no step, no piece (the same piece is taken below)
    r = post_tensors(client, path, {**body, P.POSITIONS: pos}, m)
    assert r.status_code == 200, r.get_data(as_text=True)
    parts = partition(ref, cuts)
    with torch.no_grad():
        if two_way:  # the loss of the top with the client's positions
            want = ref(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss  # packed: no cache
            assert torch.allclose(tensors_of(r)[P.LOSS].reshape(()), want, atol=1e-6, rtol=0)
        else:
            want = parts.trunk(h, None, position_ids=pos)
            assert torch.equal(tensors_of(r)[P.HIDDEN], want)
        plain = tensors_of(post_tensors(client, P.FORWARD, {P.HIDDEN: h}, {"padding": "any"}))
        given = tensors_of(post_tensors(client, P.FORWARD, {P.HIDDEN: h, P.POSITIONS: pos}, {"padding": "any"}))
    key = P.LOGITS if two_way else P.HIDDEN
    assert not torch.allclose(plain[key], given[key])  # the server used them
    if not two_way:
        assert torch.equal(given[key], want)


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_packed_sequences_give_the_unsplit_loss_and_gradients(saved, cuts, tmp_path):
    name, d = saved
    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess(cuts, optimizer="sgd", lr=0.05, model=str(d),
                             extra=["--token-file", str(tmp_path / "tokens")]) as srv:
        model = AutoSplitModelForCausalLM.from_pretrained(str(d), server=srv.url, token=TOKEN).train()
        ref = AutoModelForCausalLM.from_pretrained(d).train()
        ids, pos = packed()
        with torch.no_grad():
            unpacked = ref(input_ids=ids, labels=ids).loss
        seen = []
        # use_cache=False: the packed sequences' mask (transformers reads it from the restarting
        # positions when there is no cache); the default (the config's use_cache=True): the stock
        # model makes a cache and masks causally over the whole row, and so does the split model
        for use_cache in (False, None):
            model.zero_grad()
            ref.zero_grad()
            loss = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=use_cache).loss
            want = ref(input_ids=ids, position_ids=pos, labels=ids, use_cache=use_cache).loss
            assert abs(unpacked.item() - want.item()) > 1e-3  # the positions matter
            assert torch.allclose(loss.detach(), want.detach(), atol=1e-6, rtol=0)
            seen.append(want.item())
            loss.backward()
            want.backward()
            grads = dict(ref.named_parameters())
            tied = {"model.embed_tokens.weight"} if len(cuts) == 1 and ref.config.tie_word_embeddings else set()
            checked = 0
            for n, p in model.named_parameters():
                if n in grads and n not in tied:
                    torch.testing.assert_close(p.grad, grads[n].grad, atol=1e-6, rtol=0, msg=n)
                    checked += 1
            assert checked > 5
            with torch.no_grad():  # evaluation (/v1/forward) carries them too
                got = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=use_cache).loss
            assert abs(got.item() - want.item()) < 1e-5
        assert abs(seen[0] - seen[1]) > 1e-3  # the two masks differ: each side chose the same one
        model.zero_grad()
        model.remote.close()
