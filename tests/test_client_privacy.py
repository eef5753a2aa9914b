"""Defenses on a real client and server: what leaves the client is the defended activation."""
import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.client import SplitClient
from splitlearn.privacy import GaussianNoise, NoPeek
from splitlearn.api.wire import decode

from serverproc import TOKEN, InprocServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with InprocServerProcess((1, 3), optimizer="sgd", lr=0.1) as srv:
        yield srv


def sent_hidden(client):
    """Record every activation tensor in the bodies this client puts on the wire."""
    seen = []
    real = client.transport.start

    def start(path, body, lane=0):
        tensors, _ = decode(body)
        if P.HIDDEN in tensors:
            seen.append((path, tensors[P.HIDDEN].clone()))
        return real(path, body, lane)

    client.transport.start = start
    return seen


def test_the_server_receives_clipped_noised_activations_never_the_clean_ones(server):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    sigma, clip = 0.5, 0.1
    with SplitClient(server.url, "tiny", token=TOKEN, optimizer="sgd", lr=0.1, device="cpu",
                     defense=GaussianNoise(sigma=sigma, clip=clip)) as c:
        seen = sent_hidden(c)
        with torch.no_grad():
            clean = c.bottom(ids)  # (B, T, d): what an undefended client would send
        c.train_step(ids)
        c.evaluate(ids)
        c.generate(ids[:1, :8], max_new_tokens=3)  # transformers' generate on c.model: defended too
        with torch.no_grad():
            clean_prompt = c.bottom(ids[:1, :8])  # (1, 8, d) after the step
    prefill = next(h for p, h in seen if "/sessions/" in p)
    assert prefill.shape == clean_prompt.shape
    assert ((prefill - clean_prompt).norm(dim=-1) > 0.05).all()
    assert (prefill - GaussianNoise(sigma=sigma, clip=clip).clip_tokens(clean_prompt)).std().item() == \
        pytest.approx(sigma * clip, rel=0.3)
    paths = [p for p, _ in seen]
    assert P.TRAIN_FORWARD in paths and P.FORWARD in paths and any("/sessions/" in p for p in paths)
    for path, h in seen[:2]:  # training and evaluation carry the whole batch
        assert not torch.allclose(h, clean, atol=1e-3)
        noise = h - GaussianNoise(sigma=sigma, clip=clip).clip_tokens(clean)
        if path == P.FORWARD:  # evaluation after one SGD step: the bottom moved a little
            continue
        assert noise.std().item() == pytest.approx(sigma * clip, rel=0.15)  # N(0, (sigma*clip)^2)
    # the clean activations never appear on the wire: every sent vector is far from its clean one
    h = seen[0][1]
    assert ((h - clean).norm(dim=-1) > 0.05).float().mean() > 0.99


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_nopeek_adds_its_loss_to_the_bottom_and_sends_the_activation_unchanged(server, weight):
    """The bottom's update is the server gradient's plus, with weight > 0, the dCor term's."""
    import copy

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with SplitClient(server.url, "tiny", token=TOKEN, optimizer="sgd", lr=0.1, device="cpu",
                     defense=NoPeek(weight=weight)) as c:
        seen = sent_hidden(c)
        grads = []
        real = c.transport.call_meta

        def call_meta(path, tensors, meta=None, lane=0):
            out, info = real(path, tensors, meta, lane)
            if P.GRAD in out:
                grads.append(out[P.GRAD].clone())
            return out, info

        c.transport.call_meta = call_meta
        bottom0 = copy.deepcopy(c.bottom)
        with torch.no_grad():
            clean = c.bottom(ids)
        c.train_step(ids)
        assert torch.allclose(seen[0][1], clean, atol=1e-6)  # NoPeek changes the loss, not what is sent
        # the same step by hand: server gradient only, then + weight * dCor
        h = bottom0(ids)
        loss = (h * grads[0]).sum() + NoPeek(weight=weight).loss(bottom0.wte(ids), h)
        loss.backward()
        expected = {k: p - 0.1 * p.grad for k, p in bottom0.named_parameters() if p.grad is not None}
        actual = dict(c.bottom.named_parameters())
        for k, v in expected.items():
            if k == "wte.weight":  # tied to the top's lm_head: its gradient has a top part too
                continue
            assert torch.allclose(actual[k], v, atol=1e-6), k


# -- the same defenses on the model classes (splitlearn.hf) ----------------------------------

@pytest.mark.parametrize("shape", ["u", "2way"])
def test_model_classes_send_only_defended_activations(server, shape, tmp_path):
    """GaussianNoise on SplitGPT2LMHeadModel: training, evaluation and generate() send the
    clipped, noised activation; the gradient reaches the client's blocks through the clip."""
    from splitlearn.hf import SplitGPT2LMHeadModel

    if shape == "2way":
        srv = InprocServerProcess((2,), optimizer="sgd", lr=0.1).start()
    else:
        srv = server
    try:
        sigma, clip = 0.5, 0.1
        model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN,
                                                     defense=GaussianNoise(sigma=sigma, clip=clip))
        seen = sent_hidden(model.remote)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            h = model.transformer.wte(ids) + model.transformer.wpe(torch.arange(16))
            for i in range(model.transformer.client_blocks[0][1]):
                h = model.transformer.h[i](h)
                h = h[0] if isinstance(h, tuple) else h
        clean = h  # (2, 16, d): the bottom's output, what an undefended model sends
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert model.transformer.h[0].mlp.c_fc.weight.grad.abs().sum() > 0
        model.zero_grad()
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, labels=ids)
        model.generate(input_ids=ids[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=256)
        assert len(seen) >= 4  # training, evaluation, prefill, a decode step
        for path, sent in seen[:2]:
            assert sent.shape == clean.shape and ((sent - clean).norm(dim=-1) > 0.05).all(), path
            noise = sent - GaussianNoise(sigma=sigma, clip=clip).clip_tokens(clean)
            assert noise.std().item() == pytest.approx(sigma * clip, rel=0.15)
        prefill = seen[2][1]
        assert ((prefill - clean[:1, :8]).norm(dim=-1) > 0.05).all()
        with pytest.raises(Exception, match="Defense"):
            model.defense = "noise"
        model.remote.close()
    finally:
        if srv is not server:
            srv.stop()


def test_model_classes_add_the_nopeek_loss(server):
    """NoPeek on the model classes: the loss is the task loss + weight x dCor(embeddings, sent)."""
    from splitlearn.hf import SplitGPT2ForSequenceClassification, SplitGPT2LMHeadModel
    from splitlearn.defense.defenses import distance_correlation

    ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))
    plain = SplitGPT2LMHeadModel.from_pretrained("tiny", server=server.url, token=TOKEN).train()
    base = plain(input_ids=ids, labels=ids).loss
    plain.remote.close()
    model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=server.url, token=TOKEN,
                                                 defense=NoPeek(weight=0.5)).train()
    seen = sent_hidden(model.remote)
    out = model(input_ids=ids, labels=ids)
    extra = model.transformer.defense_loss
    emb = model.transformer.wte(ids).detach()
    want = 0.5 * distance_correlation(emb.reshape(4, -1), seen[0][1].reshape(4, -1))
    assert extra is not None and abs(extra.item() - want.item()) < 1e-4
    assert abs(out.loss.item() - (base.item() + extra.item())) < 1e-4
    model.zero_grad()
    model.remote.close()
    clf = SplitGPT2ForSequenceClassification.from_pretrained("tiny", server=server.url, token=TOKEN, num_labels=3,
                                                             pad_token_id=256, defense=NoPeek(weight=0.5)).train()
    out = clf(input_ids=ids, labels=torch.tensor([0, 1, 2, 1]))
    assert clf.transformer.defense_loss is not None and out.loss.requires_grad
    clf.zero_grad()
    clf.remote.close()
