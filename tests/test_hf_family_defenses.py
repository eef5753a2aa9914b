"""The privacy defenses on every family's split model (AutoSplitModelForCausalLM, Llama GQA and
Gemma 2, against an in-process server), computed by the one client half GPT-2's trunk also runs
(splitlearn/hf/splittrunk.py): what the server receives is the defended tensor (seeded noise: the
unsplit model's layer output, clipped, plus the same noise drawn by hand; no defense or sigma 0:
bit for bit the undefended tensor), NoPeek's loss is added to the loss, the residual design and the
gradient defense act as written by hand on the unsplit model, and a defended SGD training step on
both sides equals the same step of the unsplit model with the defense written in by hand."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn import AutoSplitModelForCausalLM, ConfigError
from splitlearn.api import protocol as P
from splitlearn.api.wire import decode
from splitlearn.defense.defenses import GaussianNoPeek, GaussianNoise, NoPeek, distance_correlation
from splitlearn.model.arch import arch_of

from serverproc import TENANTS, TOKEN, InprocServerProcess

LR = 0.05
SEED = 11


def _start(d, cuts):
    (d / "tokens").write_text("\n".join(TENANTS) + "\n")
    return InprocServerProcess(cuts, optimizer="sgd", lr=LR, model=str(d / "model"),
                               extra=["--token-file", str(d / "tokens")])


@pytest.fixture(scope="module", params=["llama-gqa", "gemma2"])
def served(request, tmp_path_factory):
    """U-shape (1, 3); the last test of the module trains its weights."""
    d = tmp_path_factory.mktemp(request.param)
    fam.model(request.param).save_pretrained(d / "model")
    with _start(d, (1, 3)) as srv:
        yield d / "model", srv


def _split(d, srv, **kw):
    return AutoSplitModelForCausalLM.from_pretrained(str(d), server=srv.url, token=TOKEN, **kw)


def _sent(model):
    """Every activation tensor the model puts on the wire, in order (the bodies decoded)."""
    seen, transport = [], model.remote.transport
    real = transport.start

    def start(path, body, lane=0):
        tensors, _ = decode(body)
        if P.HIDDEN in tensors:
            seen.append(tensors[P.HIDDEN].clone())
        return real(path, body, lane)

    transport.start = start
    return seen


def _batch():
    ids, mask = fam.padded()
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _noise(shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(SEED))


def _clip(h, c):  # per token to L2 norm <= c, by hand
    return h * (c / h.norm(dim=-1, keepdim=True).clamp_min(1e-12)).clamp(max=1.0)


def _hooked(ref, edits):
    """``ref`` with layer i's output replaced by ``edits[i](output)``: the defenses written by hand."""
    handles = []
    for i, fn in edits.items():
        def hook(_m, _args, out, fn=fn):
            return (fn(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else fn(out)
        handles.append(arch_of(ref.config).parts(ref)["layers"][i].register_forward_hook(hook))
    return handles


def _ref(d):
    return AutoModelForCausalLM.from_pretrained(d).eval()


def _ref_forward(ref, ids, mask, labels=None, hidden=False, position_ids=None):
    # no positions, as the split model is given none: both use the stock class's own (generate()'s
    # prefill: the positions from the mask it passes)
    return ref(input_ids=ids, attention_mask=mask, position_ids=position_ids, labels=labels,
               output_hidden_states=hidden)


def test_the_server_receives_the_defended_activations(served):
    """No defense and sigma 0 (a clip nothing reaches): bit for bit the unsplit model's layer
    output; seeded GaussianNoise: that output clipped plus the same noise drawn by hand, in
    evaluation, training and generate()'s prefill."""
    d, srv = served
    ref = _ref(d)
    ids, mask, labels = _batch()
    with torch.no_grad():
        clean = _ref_forward(ref, ids, mask, hidden=True).hidden_states[1]  # (B, T, d): layer 0's output
        prefill = _ref_forward(ref, ids, mask, hidden=True,  # generate()'s positions, from the mask
                               position_ids=arch_of(ref.config).positions(mask, 0, ids.shape[1])).hidden_states[1]
    model = _split(d, srv)
    seen = _sent(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    model.defense = GaussianNoise(sigma=0.0, clip=1e9)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert torch.equal(seen[0], clean) and torch.equal(seen[1], clean)
    clip = 0.5 * clean.norm(dim=-1).median().item()  # half the tokens are clipped
    model.defense = GaussianNoise(sigma=0.7, clip=clip, generator=torch.Generator().manual_seed(SEED))
    want = _clip(clean, clip) + 0.7 * clip * _noise(clean.shape)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    assert torch.allclose(seen[2], want, rtol=0, atol=1e-6)
    assert model.defense_loss is None and (seen[2] - clean).norm(dim=-1).min() > 0.05
    model.defense.generator = torch.Generator().manual_seed(SEED)
    model.train()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.allclose(seen[3], want, rtol=0, atol=1e-6)
    assert loss.requires_grad and model.defense_loss is None  # GaussianNoise adds no loss
    model.zero_grad()
    model.eval()
    model.defense.generator = torch.Generator().manual_seed(SEED)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=fam.PAD)
    assert torch.allclose(seen[4], _clip(prefill, clip) + 0.7 * clip * _noise(clean.shape), rtol=0, atol=1e-6)
    # the logits: the unsplit model with the noise written in after layer 0
    handles = _hooked(ref, {0: lambda h: _clip(h, clip) + 0.7 * clip * _noise(h.shape)})
    with torch.no_grad():
        hand = _ref_forward(ref, ids, mask).logits
    for h in handles:
        h.remove()
    assert torch.allclose(out.logits, hand, rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match="Defense"):
        model.defense = "noise"
    model.remote.close()


def test_nopeek_adds_its_loss_to_the_loss(served):
    d, srv = served
    ids, mask, labels = _batch()
    model = _split(d, srv).train()
    base = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert model.defense_loss is None
    model.zero_grad()
    model.defense = NoPeek(weight=0.5)
    seen = _sent(model)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    extra = model.defense_loss
    assert extra is model.split_decoder.defense_loss and extra.requires_grad
    tokens = model.get_input_embeddings()(ids).detach()
    want = 0.5 * distance_correlation(tokens.reshape(2, -1), seen[0].reshape(2, -1))
    assert abs(extra.item() - want.item()) < 1e-5
    assert torch.allclose(out.loss, base + extra, rtol=0, atol=1e-6)
    model.zero_grad()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, labels=labels)
    assert model.defense_loss is None  # no gradients: no extra loss
    model.remote.close()


def test_the_residual_design_is_the_hand_computed_one(served):
    """The server computes from the noised activations; the client's last layers see its clean
    stream plus the server's update (its output minus what was sent)."""
    d, srv = served
    ref = _ref(d)
    ids, mask, _ = _batch()
    sigma, clip = 0.5, 1.0
    model = _split(d, srv, defense=GaussianNoise(sigma=sigma, clip=clip, residual=True,
                                                 generator=torch.Generator().manual_seed(SEED)))
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    kept = {}

    def send(h):
        kept["clean"], kept["sent"] = h, _clip(h, clip) + sigma * clip * _noise(h.shape)
        return kept["sent"]

    handles = _hooked(ref, {0: send, 2: lambda out: kept["clean"] + (out - kept["sent"])})
    with torch.no_grad():
        hand = _ref_forward(ref, ids, mask).logits
    for h in handles:
        h.remove()
    assert torch.allclose(got, hand, rtol=0, atol=1e-5)
    handles = _hooked(ref, {0: send})  # without the residual design: another answer
    with torch.no_grad():
        plain = _ref_forward(ref, ids, mask).logits
    for h in handles:
        h.remove()
    assert (plain - hand).abs().max() > 1e-3
    with pytest.raises(ConfigError, match="micro_batches"):
        model.micro_batches = 2
    model.remote.close()


def test_micro_batches_defend_each_micro_batch(served):
    """micro_batches=2: each micro-batch's activations are defended as they are sent (the seeded
    noise drawn per micro-batch, in order), NoPeek's loss is each micro-batch's weighted by its rows."""
    d, srv = served
    ids, mask = fam.padded(batch=4)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        clean = _ref_forward(_ref(d), ids, mask, hidden=True).hidden_states[1]  # (4, T, d)
    sigma, clip, weight = 0.5, 1.0, 0.3
    model = _split(d, srv, micro_batches=2, defense=GaussianNoPeek(
        sigma=sigma, clip=clip, weight=weight, generator=torch.Generator().manual_seed(SEED))).train()
    seen = _sent(model)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert len(seen) == 2  # one request per micro-batch
    g = torch.Generator().manual_seed(SEED)
    tokens = model.get_input_embeddings()(ids).detach()
    extra = 0.0
    for sent, part, tok in zip(seen, torch.tensor_split(clean, 2), torch.tensor_split(tokens, 2)):
        want = _clip(part, clip) + sigma * clip * torch.randn(part.shape, generator=g)
        assert torch.allclose(sent, want, rtol=0, atol=1e-6)
        extra += 0.5 * weight * distance_correlation(tok.reshape(2, -1), part.reshape(2, -1)).item()
    assert abs(model.defense_loss.item() - extra) < 1e-5
    out.loss.backward()
    model.zero_grad()
    model.remote.close()


def _sent_gradient(model, ids, mask, labels):
    """The gradient the client sends back at the second cut in one training backward."""
    sent, steps = [], model.remote.steps
    real = steps.send_backward

    def record(piece, grad, dtype, device):
        sent.append(grad.detach().clone())
        return real(piece, grad, dtype, device)

    steps.send_backward = record
    try:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    finally:
        del steps.send_backward
    model.zero_grad()
    assert len(sent) == 1
    return sent[0]  # (B, T, d)


def test_the_gradient_defense_clips_and_noises_the_gradient_sent_back(served):
    d, srv = served
    ids, mask, labels = _batch()
    model = _split(d, srv).train()
    clean = _sent_gradient(model, ids, mask, labels)
    n = ids.shape[0] * (ids.shape[1] - 1)  # grad_clip's units: the loss summed over the B * (T - 1) targets
    c = (clean * n).norm(dim=-1).median().item()
    model.defense = GaussianNoise(sigma=0.0, clip=1e9, grad_clip=c, grad_sigma=0.0)
    assert torch.allclose(_sent_gradient(model, ids, mask, labels), _clip(clean * n, c) / n, rtol=0, atol=1e-9)
    model.defense = GaussianNoise(sigma=0.0, clip=1e9, grad_clip=c, grad_sigma=2.0,
                                  generator=torch.Generator().manual_seed(SEED))
    model.defense.generator.manual_seed(SEED)
    got = _sent_gradient(model, ids, mask, labels)
    want = (_clip(clean * n, c) + 2.0 * c * _noise(clean.shape)) / n
    assert torch.allclose(got, want, rtol=0, atol=1e-7)
    with pytest.raises(ConfigError, match="micro_batches"):
        model.micro_batches = 2
    model.defense = None
    model.micro_batches = 2
    with pytest.raises(ConfigError, match="micro_batches"):
        model.defense = GaussianNoise(sigma=1.0, clip=1.0, grad_clip=1.0)
    model.remote.close()


def test_a_defended_training_step_equals_the_hand_computed_step(served):
    """GaussianNoise + NoPeek, seeded: loss, client gradients, the SGD step on both sides and the
    next loss equal the unsplit model's with the defense written in by hand. Trains the server."""
    d, srv = served
    ids, mask, labels = _batch()
    sigma, clip, weight = 0.3, 2.0, 0.4
    model = _split(d, srv, defense=GaussianNoPeek(sigma=sigma, clip=clip, weight=weight,
                                                  generator=torch.Generator().manual_seed(SEED))).train()
    ref = AutoModelForCausalLM.from_pretrained(d).train()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    kept = {}

    def send(h):
        kept["h"] = h
        return _clip(h, clip) + sigma * clip * _noise(h.shape)

    handles = _hooked(ref, {0: send})
    task = _ref_forward(ref, ids, mask, labels).loss
    for h in handles:
        h.remove()
    tokens = ref.get_input_embeddings()(ids).detach()
    want = task + weight * distance_correlation(tokens.reshape(2, -1), kept["h"].reshape(2, -1))
    assert torch.allclose(out.loss, want, rtol=0, atol=1e-6)
    out.loss.backward()
    want.backward()
    grads = dict(ref.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        if name in grads and p.grad is not None:
            assert torch.allclose(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6), name
            checked += 1
    assert checked > 5
    opt.step()
    ref_opt.step()
    model.remote.flush()
    model.defense = None
    model.eval()
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask, labels=labels).loss  # the server stepped too
        want = _ref_forward(ref.eval(), ids, mask, labels).loss
    assert abs(after.item() - want.item()) < 1e-5
    model.remote.close()


@pytest.mark.parametrize("name", ["llama-gqa"])
def test_two_way_sends_the_defended_activations_and_adds_the_nopeek_loss(name, tmp_path):
    """2-way: the seeded noise on what is sent (training and evaluation), NoPeek's loss added to
    the server's loss; the residual design and the gradient defense are refused (U-shape only)."""
    fam.model(name).save_pretrained(tmp_path / "model")
    ids, mask, labels = _batch()
    ref = _ref(tmp_path / "model")
    with torch.no_grad():
        clean = _ref_forward(ref, ids, mask, hidden=True).hidden_states[2]  # the cut at 2
    with _start(tmp_path, (2,)) as srv:
        model = _split(tmp_path / "model", srv).train()
        base = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        model.zero_grad()
        sigma, clip, weight = 0.5, 2.0, 0.3
        model.defense = GaussianNoPeek(sigma=sigma, clip=clip, weight=weight,
                                       generator=torch.Generator().manual_seed(SEED))
        seen = _sent(model)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        want = _clip(clean, clip) + sigma * clip * _noise(clean.shape)
        assert torch.allclose(seen[0], want, rtol=0, atol=1e-6)
        tokens = model.get_input_embeddings()(ids).detach()
        extra = weight * distance_correlation(tokens.reshape(2, -1), clean.reshape(2, -1))
        assert abs(model.defense_loss.item() - extra.item()) < 1e-5
        handles = _hooked(ref, {1: lambda h: _clip(h, clip) + sigma * clip * _noise(h.shape)})
        with torch.no_grad():
            task = _ref_forward(ref, ids, mask, labels).loss  # the server's loss on what it received
        for h in handles:
            h.remove()
        assert abs(loss.item() - (task.item() + extra.item())) < 1e-5
        assert abs(task.item() - base.item()) > 1e-4  # the noise moved the task loss
        model.zero_grad()
        model.eval()
        model.defense.generator.manual_seed(SEED)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, labels=labels)
        assert torch.allclose(seen[1], want, rtol=0, atol=1e-6)
        for bad in (GaussianNoise(sigma=1.0, clip=1.0, residual=True), GaussianNoise(1.0, 1.0, grad_clip=1.0)):
            with pytest.raises(ConfigError, match="U-shape"):
                model.defense = bad
        model.remote.close()


def test_gpt2s_split_classes_expose_defense_loss_on_the_model_too(tmp_path):
    """``model.defense_loss`` on every split model (SplitClient reads it): GPT-2's is its trunk's."""
    from splitlearn import SplitGPT2LMHeadModel

    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess((1, 3), extra=["--token-file", str(tmp_path / "tokens")]) as srv:
        model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN,
                                                     defense=NoPeek(weight=0.5)).train()
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        out = model(input_ids=ids, labels=ids)
        extra = model.defense_loss
        assert extra is not None and extra is model.transformer.defense_loss
        model.defense = None
        base = model(input_ids=ids, labels=ids).loss
        assert model.defense_loss is None
        assert abs(out.loss.item() - (base.item() + extra.item())) < 1e-5
        model.zero_grad()
        model.remote.close()
