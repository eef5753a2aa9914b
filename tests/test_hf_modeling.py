"""Split GPT-2 as a transformers model (issue 20, items 1-3) against real server processes.

One server per shape (U-shape cuts (1, 3), 2-way cut 2), shared by the module's tests. Every
test that trains compares with the unsplit model started from the server's state *now*
(weights and AdamW state read back from its checkpoint), so the tests do not depend on their
order: the client side starts from the ``tiny`` spec, the server side from wherever the
earlier tests left it. 2-way: the server's LM head is its own copy of ``wte``, so the
reference unties it.
"""
import copy
import json

import pytest
import torch
from torch import nn
from torch.optim import optimizer as optimizer_hooks

from splitlearn import load_model
from splitlearn.api import protocol as P
from splitlearn.model.checkpoint import load_state
from splitlearn.errors import BadRequest, ConfigError
from splitlearn.hf import (SplitGPT2ForSequenceClassification, SplitGPT2LMHeadModel, SplitGPT2Model,
                           split_model)
from splitlearn.model.partition import partition
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from serverproc import OTHER, TENANTS, TOKEN, InprocServerProcess, auth, web

pytestmark = pytest.mark.slow

LR = 1e-2
ATOL, RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module", params=[(1, 3), (2,)], ids=["u", "2way"])
def server(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf-modeling")
    (d / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess(request.param, lr=LR, checkpoint_dir=d / "ckpt",
                             extra=["--token-file", str(d / "tokens")]) as srv:
        srv.cuts, srv.u_shape = request.param, len(request.param) == 2
        yield srv


def batches(n: int, seed: int = 0, rows: int = 2, T: int = 12):
    """(input_ids, attention_mask, labels): left-padded, right-padded and unpadded rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, 256, (rows, T), generator=g)
        mask = torch.ones(rows, T, dtype=torch.long)
        if i % 3 == 1:
            mask[0, :3] = 0  # left padding
        elif i % 3 == 2:
            mask[-1, -4:] = 0  # right padding (a Trainer collator's)
        ids = ids.masked_fill(mask == 0, 256)
        out.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return out


def reference(srv):
    """The unsplit model as the split one is now: client side from the spec, the server's
    segment and its AdamW state from the server's checkpoint. Returns (model, {name: state})."""
    r = web.post(srv.url + P.CHECKPOINT, json={}, headers=auth(), timeout=60)
    assert r.status_code == 200, r.text
    ref = load_model("tiny")
    if not srv.u_shape:  # 2-way: the server's LM head is its own copy of wte
        ref.config.tie_word_embeddings = False
        ref.lm_head.weight = nn.Parameter(ref.transformer.wte.weight.detach().clone())
    parts = partition(ref, srv.cuts)
    seg = parts.trunk if srv.u_shape else parts.top
    opt = torch.optim.AdamW(seg.parameters(), lr=LR, weight_decay=0.0)
    load_state(srv.checkpoint_dir, "server", [seg], opt)
    names = {id(p): n for n, p in ref.named_parameters()}
    return ref, {names[id(p)]: s for p, s in opt.state.items()}


def adamw_with(model, state: dict) -> torch.optim.AdamW:
    """AdamW over ``model`` carrying the server's state for the server's parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for name, p in model.named_parameters():
        if name in state:
            opt.state[p] = copy.deepcopy(state[name])
    assert len(opt.state) == len(state)
    return opt


def step_apply(remote) -> dict:
    """The apply of the step just taken: deferred (carried by the next step's first forward), or
    already sent and answered (the server asked for it at once: other clients use the segment)."""
    return remote.deferred.to_json() if remote.deferred is not None else remote.last_apply


def split_lm(srv, **kw) -> SplitGPT2LMHeadModel:
    return SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, **kw).train()


def assert_weights_equal(split, ref, srv, prefix: str = "", atol: float = ATOL):
    """Every client weight of ``split`` and every server weight equals ``ref``'s."""
    split.flush()  # the last step's apply rides on the next step's first request: sent now
    expected = {k.removeprefix(prefix): v for k, v in ref.state_dict().items()}
    client = {k: v for k, v in split.state_dict().items() if "remote." not in k}
    assert client, "no client weights"
    for name, w in client.items():
        assert torch.allclose(w, expected[name], atol=atol, rtol=RTOL), \
            f"client {name}: {float((w - expected[name]).abs().max())}"
    server = srv.weights()
    for name, w in server.items():
        key = name if name in expected else name.removeprefix("transformer.")
        if prefix and key.startswith("lm_head"):
            continue
        assert torch.allclose(w, expected[key], atol=atol, rtol=RTOL), \
            f"server {name}: {float((w - expected[key]).abs().max())}"


# -- (a) forward == unsplit -----------------------------------------------------------------

def test_forward_equals_unsplit(server):
    model = split_lm(server).eval()
    ref, _ = reference(server)
    assert isinstance(model, SplitGPT2LMHeadModel) and model.remote.cuts == server.cuts
    assert not any(n.startswith(f"transformer.h.{server.cuts[0]}.") for n in model.state_dict())  # no server weights
    for ids, mask, labels in batches(3):
        with torch.no_grad():
            a = model(input_ids=ids, attention_mask=mask, labels=labels)
            b = ref(input_ids=ids, attention_mask=mask, labels=labels)
        assert torch.allclose(a.logits, b.logits, atol=1e-5), float((a.logits - b.logits).abs().max())
        assert abs(a.loss.item() - b.loss.item()) < 1e-5
    # with gradients: the loss (and, U-shape, the logits) through the autograd Function
    ids, mask, labels = batches(1, seed=5)[0]
    a = model(input_ids=ids, attention_mask=mask, labels=labels)
    b = ref(input_ids=ids, attention_mask=mask, labels=labels)
    assert abs(a.loss.item() - b.loss.item()) < 1e-5 and a.loss.requires_grad
    if server.u_shape:
        assert model.lm_head.weight is model.transformer.wte.weight  # tied, as in GPT2LMHeadModel
        assert torch.allclose(a.logits, b.logits, atol=1e-5)
    else:
        assert a.logits is None  # the server computes the loss and answers only it
        with pytest.raises(ConfigError, match="needs labels"):
            model(input_ids=ids, attention_mask=mask)
    model.remote.close()  # the forward's piece is dropped on the server (nothing was backpropagated)


# -- (b) a plain loop: AdamW, gradient accumulation, LambdaLR, global clipping ----------------

def test_plain_loop_equals_unsplit(server):
    model = split_lm(server)
    ref, state = reference(server)
    ref.train()
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0), adamw_with(ref, state)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    data = batches(6, seed=1)
    thrown = batches(1, seed=9)[0]
    accum, clip, clipped = 2, 0.6, []
    for step in range(3):
        if step == 0:  # a backward thrown away by zero_grad: discarded on the server too
            for m, o in ((model, opt), (ref, ref_opt)):
                ids, mask, labels = thrown
                m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
                o.zero_grad()
        calls, applies = model.remote.stats.calls, model.remote.applies
        for k in range(accum):
            ids, mask, labels = data[step * accum + k]
            for m in (model, ref):
                (m(input_ids=ids, attention_mask=mask, labels=labels).loss / accum).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        assert abs(float(norm) - float(ref_norm)) < 1e-4 * float(ref_norm)  # the global norm, both sides
        clipped.append(model.remote.link.clip_factor() < 1.0)
        for o, s in ((opt, sched), (ref_opt, ref_sched)):
            o.step()
            s.step()
            o.zero_grad()
        # 2 tensor requests per piece (forward, backward); the apply rides on the next step's first forward
        assert model.remote.stats.calls - calls == 2 * accum and model.remote.applies == applies + 1
        carried = step_apply(model.remote)
        assert carried["step"] == step + 1 and carried["pieces"] == accum
        assert carried["lr"] == pytest.approx(LR / (1 + step), rel=1e-12)
        if step and model.remote.deferred is not None:  # the previous one came back with this step's first forward
            assert model.remote.last_apply["applied"] and model.remote.last_apply["step"] == step
            assert model.remote.last_apply["lr"] == pytest.approx(LR / step, rel=1e-12)
    assert any(clipped), "the clip never acted: the test proves nothing about it"
    assert model.remote.step == model.remote.applies + 1
    assert_weights_equal(model, ref, server)


class OwnZeroGrad(torch.optim.AdamW):
    """An optimizer whose ``zero_grad`` is its own (it never calls torch's)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def test_an_optimizer_with_its_own_zero_grad_and_nothing_of_torch_patched(server):
    """The optimizer is found and hooked per instance (torch.optim is left as it is); a
    zero_grad of the optimizer's own class between a backward and the step still discards
    the server's pending pieces (seen as the proxy's gradient gone at the next forward)."""
    zero_grad, step_hooks = torch.optim.Optimizer.zero_grad, dict(optimizer_hooks._global_optimizer_post_hooks)
    model = split_lm(server)
    ref, state = reference(server)
    ref.train()
    opt, ref_opt = OwnZeroGrad(model.parameters(), lr=LR, weight_decay=0.0), adamw_with(ref, state)
    thrown = batches(1, seed=11)[0]
    for step, (ids, mask, labels) in enumerate(batches(3, seed=12)):
        if step == 1:  # a backward thrown away by the optimizer's own zero_grad
            for m, o in ((model, opt), (ref, ref_opt)):
                m(input_ids=thrown[0], attention_mask=thrown[1], labels=thrown[2]).loss.backward()
                o.zero_grad()
        for m, o in ((model, opt), (ref, ref_opt)):
            m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            o.step()
            o.zero_grad()
        assert step_apply(model.remote)["pieces"] == 1
    assert model.remote.applies == 3 and model.remote.step == 4
    assert_weights_equal(model, ref, server)
    assert torch.optim.Optimizer.zero_grad is zero_grad and zero_grad.__module__.startswith("torch.")
    assert dict(optimizer_hooks._global_optimizer_post_hooks) == step_hooks
    model.remote.close()


def test_an_optimizer_made_after_the_first_backward_still_steps_the_server(server):
    """Not found at the backward (it did not exist): its step moved the proxy, and the next
    forward finds it and applies that step before the new one starts."""
    model = split_lm(server)
    ids, mask, labels = batches(1, seed=13)[0]
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.step()
    opt.zero_grad()
    assert model.remote.applies == 0  # no hook yet
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert model.remote.applies == 1 and model.remote.last_apply["pieces"] == 1 and model.remote.step == 2
    opt.step()  # hooked now: applied at once
    assert model.remote.applies == 2 and model.remote.step == 3
    model.remote.close()


def _flat_update(after: dict, before: dict, names) -> torch.Tensor:
    return torch.cat([(after[n] - before[n]).flatten() for n in names])


@pytest.mark.parametrize("wire", ["bfloat16", "int8"])
def test_lossy_wire_training_follows_unsplit(server, wire):
    """On a lossy wire the split model is not bit-exact, but it trains the same model: each
    step's loss is the unsplit loss to the wire's precision, and the update each side applies
    points the way the unsplit update does (cosine > 0.9 on either side of the cut)."""
    model = split_lm(server, wire_dtype=wire)
    ref, state = reference(server)
    ref.train()
    start = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0), adamw_with(ref, state)
    for ids, mask, labels in batches(3, seed=3):
        losses = []
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = m(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 2e-2 * abs(losses[1]), (wire, losses)
    want = ref.state_dict()
    client = {k: v for k, v in model.state_dict().items() if "remote." not in k}
    names = sorted(client)
    assert torch.nn.functional.cosine_similarity(_flat_update(client, start, names),
                                                 _flat_update(want, start, names), dim=0) > 0.9
    server_w = server.weights()
    key = {n: n if n in want else n.removeprefix("transformer.") for n in server_w}
    names = sorted(n for n in server_w if not key[n].startswith("lm_head") or not server.u_shape)
    got = torch.cat([(server_w[n] - start[key[n]]).flatten() for n in names])
    assert got.abs().max() > 0  # the server stepped
    assert torch.nn.functional.cosine_similarity(got, _flat_update(want, start, [key[n] for n in names]), dim=0) > 0.9
    model.remote.close()


# -- (c) transformers.Trainer + datasets ------------------------------------------------------

@pytest.mark.parametrize("micro", [1, 2], ids=["whole", "pipelined"])
def test_trainer_equals_unsplit(server, tmp_path, micro):
    datasets = pytest.importorskip("datasets")
    from transformers import Trainer, TrainingArguments

    rows = [b for ids, mask, labels in batches(4, seed=3) for b in zip(ids, mask, labels)]
    ds = datasets.Dataset.from_dict({"input_ids": [r[0].tolist() for r in rows],
                                     "attention_mask": [r[1].tolist() for r in rows],
                                     "labels": [r[2].tolist() for r in rows]})

    def run(model, opt, out):
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=2, learning_rate=LR, lr_scheduler_type="linear", logging_steps=1,
                                 report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                                 dataloader_num_workers=0, max_grad_norm=0.5)
        trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None))
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], \
            [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]

    model = split_lm(server, micro_batches=micro)  # 2: each batch of 2 rows in two pieces in flight
    ref, state = reference(server)
    # the stock class's loss_type (load_model names its own): Trainer counts the targets by it
    ref.loss_type = GPT2LMHeadModel(ref.config).loss_type
    losses, norms = run(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0), tmp_path / "split")
    ref_losses, ref_norms = run(ref, adamw_with(ref, state), tmp_path / "ref")
    assert len(losses) == 2
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert norms == pytest.approx(ref_norms, rel=1e-4)  # Trainer's logged norm is the global one
    assert model.remote.applies == 2 and model.remote.last_apply["pieces"] == 2 * micro
    # 2-way under Trainer (and pipelined pieces): the mean loss of a piece x (its targets /
    # num_items_in_batch) is HF's sum / num_items_in_batch up to rounding, which AdamW's
    # m / sqrt(v) magnifies for the weights whose gradients are near zero (~1e-4 after two
    # steps at lr 1e-2)
    assert_weights_equal(model, ref, server, atol=ATOL if server.u_shape and micro == 1 else 1e-3)


# -- (d) sequence classification --------------------------------------------------------------

def test_sequence_classification_equals_unsplit(server):
    if not server.u_shape:
        with pytest.raises(ConfigError, match="U-shape"):
            SplitGPT2ForSequenceClassification.from_pretrained("tiny", server=server.url, token=TOKEN, num_labels=3)
        return
    ref_lm, state = reference(server)
    cfg = copy.deepcopy(ref_lm.config)
    cfg.num_labels, cfg.pad_token_id = 3, 256
    torch.manual_seed(0)
    ref = GPT2ForSequenceClassification(cfg)
    ref.transformer.load_state_dict(ref_lm.transformer.state_dict())
    src = copy.deepcopy(ref)  # its server-side blocks as the server loaded them (compared at session start)
    at_load = load_model("tiny").transformer.state_dict()
    src.transformer.load_state_dict({k: v for k, v in at_load.items()
                                     if k.split(".")[0] == "h" and int(k.split(".")[1]) in range(*server.cuts)},
                                    strict=False)
    model = split_model(src, server=server.url, token=TOKEN).train()
    ref.train()
    assert type(model) is SplitGPT2ForSequenceClassification
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0), adamw_with(ref, state)
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        for ids, mask, _ in batches(2, seed=10 + step):
            y = torch.randint(0, 3, (ids.shape[0],), generator=g)
            a = model(input_ids=ids, attention_mask=mask, labels=y)
            b = ref(input_ids=ids, attention_mask=mask, labels=y)
            assert torch.allclose(a.logits, b.logits, atol=1e-5)
            (a.loss / 2).backward()
            (b.loss / 2).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_weights_equal(model, ref, server)
    with torch.no_grad():  # evaluation: /v1/forward, nothing changes
        ids, mask, _ = batches(1, seed=20)[0]
        assert torch.allclose(model(input_ids=ids, attention_mask=mask).logits,
                              ref(input_ids=ids, attention_mask=mask).logits, atol=1e-5)


def test_any_head_from_pretrained_pools_a_padded_batch(server):
    """Issue 41: README's 'Any head' (``from_pretrained(..., num_labels=3)``) on a batch of 2 raised
    "Cannot handle batch sizes > 1 if no padding token is defined": the pad token is now the eos,
    as transformers advises for GPT-2, and the pooled logits equal the unsplit model's."""
    if not server.u_shape:
        pytest.skip("a 2-way server serves the LM head only")
    model = SplitGPT2ForSequenceClassification.from_pretrained("tiny", server=server.url, token=TOKEN, num_labels=3)
    try:
        assert model.config.pad_token_id == model.config.eos_token_id == 256
        ref_lm, _ = reference(server)
        cfg = copy.deepcopy(ref_lm.config)
        cfg.num_labels, cfg.pad_token_id = 3, 256
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # from_pretrained's seed: the same score head
            ref = GPT2ForSequenceClassification(cfg).eval()
        ref.transformer.load_state_dict(ref_lm.transformer.state_dict())
        ids, mask, _ = batches(3, seed=30)[2]  # 2 rows, the second right-padded with 256
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask).logits
            want = ref(input_ids=ids, attention_mask=mask).logits
        assert got.shape == (2, 3) and torch.allclose(got, want, atol=1e-5)
    finally:
        model.transformer.remote.close()


def test_from_pretrained_takes_an_export_directory(server, tmp_path):
    """Issue 41: ``from_pretrained`` refused a directory of exported segments ("has no
    config.json") that ``SplitClient`` takes: it builds the client from the segments there, equal
    to the same weights loaded from the spec; another split's export is refused by name."""
    from splitlearn import export_segments
    from splitlearn.client import SplitClient

    export_segments(load_model("tiny"), server.cuts, tmp_path / "ex")
    ids, mask, _ = batches(3, seed=31)[1]
    logits = {}
    with torch.no_grad():
        for kw in ({}, {"num_labels": 3}):
            if kw and not server.u_shape:
                continue  # a 2-way server serves the LM head only
            cls = SplitGPT2ForSequenceClassification if kw else SplitGPT2LMHeadModel
            models = [cls.from_pretrained(src, server=server.url, token=TOKEN, **kw) for src in ("tiny", tmp_path / "ex")]
            try:
                if kw:  # a fresh head on either: the same one, to compare the rest
                    models[1].score.weight.copy_(models[0].score.weight)
                spec, export = (m(input_ids=ids, attention_mask=mask).logits for m in models)
                assert torch.allclose(spec, export, atol=1e-6), cls.__name__
                assert sum(p.numel() for p in models[1].parameters()) == sum(p.numel() for p in models[0].parameters())
                logits[cls] = spec
            finally:
                for m in models:
                    m.transformer.remote.close()
        with SplitClient(server.url, tmp_path / "ex", token=TOKEN, device="cpu") as client:  # as before
            got = client.model.eval()(input_ids=ids, attention_mask=mask).logits
        assert torch.allclose(got, logits[SplitGPT2LMHeadModel], atol=1e-6)
    other = (2,) if server.u_shape else (1, 3)
    export_segments(load_model("tiny"), other, tmp_path / "other")
    with pytest.raises(ConfigError, match="cut at"):
        SplitGPT2LMHeadModel.from_pretrained(tmp_path / "other", server=server.url, token=TOKEN)


# -- (e) refused applies change nothing; tenants ------------------------------------------------

def post_apply(srv, payload, token=TOKEN):
    return web.post(srv.url + P.TRAIN_APPLY, data=json.dumps(payload),
                    headers={**auth(token), "Content-Type": "application/json"}, timeout=30)


def test_bad_applies_change_nothing(server):
    model = split_lm(server)
    ids, mask, labels = batches(1, seed=7)[0]
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    before = server.weights()
    cid, step = model.client_id, model.remote.step
    good = {"client_id": cid, "step": step, "pieces": 1, "lr": 1e-3}
    for bad, status, words in [
            ({**good, "lr": 11.0}, 400, "'lr' must be in"), ({**good, "lr": -1e-3}, 400, "'lr' must be in"),
            ({**good, "lr": "0.1"}, 400, "must be a number"), ({**good, "lr": True}, 400, "must be a number"),
            ({k: v for k, v in good.items() if k != "lr"}, 400, "must be a number"),
            ({**good, "clip": 1.5}, 400, "'clip'"), ({**good, "clip": 0}, 400, "'clip'"),
            ({**good, "pieces": 0}, 400, "pieces"), ({**good, "step": 0}, 400, "'step'"),
            ({**good, "surprise": 1}, 400, "unknown fields"), ({**good, "client_id": "a:b"}, 400, "client_id"),
            ({**good, "step": step + 1}, 409, f"no step {step + 1} is pending"),
            ({**good, "pieces": 2}, 409, "backward pieces")]:
        r = post_apply(server, bad)
        assert r.status_code == status, (bad, r.text)
        assert set(r.json()) == {"error", "message"} and words.lower() in r.json()["message"].lower(), r.json()
    r = web.post(server.url + P.TRAIN_APPLY, data=b'{"lr": NaN, "client_id": "x"}',
                 headers={**auth(), "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"] == "bad_request"
    # another tenant cannot apply (or discard) this step: its "cid" is a client of its own
    r = post_apply(server, good, token=OTHER)
    assert r.status_code == 409 and f"no step {step} is pending" in r.json()["message"]
    r = post_apply(server, {"client_id": cid, "step": step, "discard": True}, token=OTHER)
    assert r.status_code == 200 and r.json()["discarded"]
    after = server.weights()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing changed
    # the step is still pending, whole: the owner applies it, exactly once
    first = post_apply(server, good)
    assert first.status_code == 200 and first.json()["applied"], first.text
    applied = server.weights()
    assert any(not torch.equal(before[k], applied[k]) for k in before)
    again = post_apply(server, good)  # a retry: the stored answer, nothing applied twice
    assert again.json() == first.json()
    assert all(torch.equal(applied[k], v) for k, v in server.weights().items())
    model.zero_grad()


def test_apply_request_validation():
    ok = P.ApplyRequest.from_json({"client_id": "a", "step": 3, "pieces": 2, "lr": 0.5, "clip": 0.25})
    assert ok == P.ApplyRequest("a", 3, 2, 0.5, 0.25) and P.ApplyRequest.from_json(ok.to_json()) == ok
    assert P.ApplyRequest.from_json({"client_id": "a", "step": 1, "discard": True}).discard
    for bad in [{"client_id": "a", "step": 1, "pieces": 1, "lr": float("inf")},
                {"client_id": "a", "step": 1, "pieces": P.MAX_PIECES + 1, "lr": 0.1},
                {"client_id": "a", "step": 1.0, "pieces": 1, "lr": 0.1}]:
        with pytest.raises(BadRequest):
            P.ApplyRequest.from_json(bad)
    m = P.StepMeta.from_meta({"client_id": "a", "step": "1", "micro": "100", "micros": "0"})
    assert m.micro == 100 and m.to_meta()["micros"] == "0"
    with pytest.raises(BadRequest):
        P.StepMeta.from_meta({"client_id": "a", "step": "1", "micro": str(P.MAX_PIECES), "micros": "0"})
    for closed in ({"micros": "1"}, {"micros": "3", "micro": "1"}, {}):  # closed steps are gone
        with pytest.raises(BadRequest, match="closed training steps"):
            P.StepMeta.from_meta({"client_id": "a", "step": "1", **closed})


# -- peft on the client's modules ---------------------------------------------------------------

def test_peft_on_client_modules(server):
    peft = pytest.importorskip("peft")
    if not server.u_shape:
        pytest.skip("one shape is enough")
    base = split_lm(server)
    frozen = {k: v.clone() for k, v in base.state_dict().items() if "remote." not in k}
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                      fan_in_fan_out=True))
    assert not any("h.1." in n or "h.2." in n for n, _ in model.named_parameters() if "lora" in n)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    before = server.weights()
    for ids, mask, labels in batches(2, seed=12):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    assert base.remote.applies == 2  # the optimizer over the adapters drives the server's steps
    after = server.weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    state = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
             for k, v in model.state_dict().items() if "lora_" not in k and "remote." not in k}
    assert all(torch.equal(state[k], v) for k, v in frozen.items())  # the base stays frozen
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters() if "lora_B" in n)


def test_trunk_model_alone(server):
    if not server.u_shape:
        with pytest.raises(ConfigError, match="U-shape"):
            SplitGPT2Model.from_pretrained("tiny", server=server.url, token=TOKEN)
        return
    trunk = SplitGPT2Model.from_pretrained("tiny", server=server.url, token=TOKEN)
    ref, _ = reference(server)
    ids, mask, _ = batches(1, seed=30)[0]
    with torch.no_grad():
        assert torch.allclose(trunk(input_ids=ids, attention_mask=mask).last_hidden_state,
                              ref.transformer(input_ids=ids, attention_mask=mask).last_hidden_state, atol=1e-5)
