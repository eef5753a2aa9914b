"""SplitClient against the server: training. The server's app runs in this process
(tests/serverproc.py's InprocServerProcess), except for the restarts, which SIGTERM a real
``python -m splitlearn.server`` process on loopback and start it again.

N split steps must leave every weight, on both sides, equal to N steps of the unsplit model
with the same optimizer and data (float32 wire). In 2-way the server's LM head is its own copy
of ``wte`` (documented in splitlearn.client.core), so the reference unties it; the U-shape keeps
the tie. Server weights are read from the checkpoint it writes on POST /v1/checkpoint.
"""
import shutil

import pytest
import torch
from torch import nn

from splitlearn import load_model
from splitlearn.model.checkpoint import has_state
from splitlearn.client import SplitClient
from splitlearn.errors import Conflict
from splitlearn.model.segments import labels_from_batch, positions_from_mask

from serverproc import TOKEN, InprocServerProcess, ServerProcess

pytestmark = pytest.mark.slow

LR = {"sgd": 0.5, "adamw": 1e-2}
ATOL = 1e-5


def _batches():
    """Four (input_ids, attention_mask) batches (2, 12): the first unpadded, the rest left-padded."""
    g = torch.Generator().manual_seed(0)
    out = []
    for pad in (0, 3, 5, 1):
        ids = torch.randint(0, 256, (2, 12), generator=g)
        mask = None
        if pad:
            mask = torch.ones(2, 12, dtype=torch.long)
            mask[0, :pad] = 0
            ids[0, :pad] = 256
        out.append((ids, mask))
    return out


BATCHES = _batches()


def unsplit_steps(cuts, optimizer, batches):
    """The whole model trained on ``batches``: (model, losses)."""
    model = load_model("tiny")
    if len(cuts) == 1:  # 2-way: the server's lm_head is a separate copy of wte
        model.config.tie_word_embeddings = False
        model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())
    return model, train_whole(model, list(model.parameters()), optimizer, batches)


def train_whole(model, params, optimizer: str, batches) -> list[float]:
    """Train ``params`` of an unsplit ``model`` on ``batches`` (positions as generate() derives
    them); the losses. The reference every split-training test compares with."""
    opt = torch.optim.AdamW(params, lr=LR[optimizer], weight_decay=0.0) if optimizer == "adamw" else \
        torch.optim.SGD(params, lr=LR[optimizer])
    model.train()
    losses = []
    for ids, mask in batches:
        opt.zero_grad()
        pos = positions_from_mask(mask, ids.shape[1]) if mask is not None else None
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels_from_batch(ids, mask))
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return losses


def assert_both_sides_equal(reference, client: SplitClient, server: ServerProcess):
    """Every weight of the client's segments and of the server's equals the reference's."""
    expected = reference.state_dict()
    initial = load_model("tiny").state_dict()
    client.flush()  # the last step's apply rides on the next request: send it before reading the server
    sides = {"client": {k: v for s in client.segments for k, v in s.hf_state_dict().items()},
             "server": server.weights()}
    assert_sides_match(expected, initial, sides, {n for n, _ in reference.named_parameters()} | {"lm_head.weight"})


def assert_sides_match(expected: dict, initial: dict, sides: dict, params: set) -> None:
    """Each side's weights (``sides``: side -> {name: tensor}) within ATOL of ``expected``, each side
    moved from ``initial`` by more than 100 x ATOL, and every name in ``params`` checked on a side."""
    for side, weights in sides.items():
        moved = 0.0
        for name, w in weights.items():
            assert torch.allclose(w, expected[name], atol=ATOL, rtol=0), f"{side} {name}"
            moved = max(moved, float((w - initial[name]).abs().max()))
        assert moved > 100 * ATOL, f"{side} weights barely moved ({moved}): the test proves nothing"
    assert params <= set(sides["client"]) | set(sides["server"])  # nothing left unchecked


@pytest.fixture(scope="module", params=[((2,), "sgd"), ((2,), "adamw"), ((1, 3), "sgd"), ((1, 3), "adamw")],
                ids=["2way-sgd", "2way-adamw", "u-sgd", "u-adamw"])
def server(request, tmp_path_factory):
    cuts, optimizer = request.param
    srv = InprocServerProcess(cuts, optimizer=optimizer, lr=LR[optimizer],
                              checkpoint_dir=tmp_path_factory.mktemp("server"))
    srv.cuts, srv.optimizer = cuts, optimizer
    with srv:
        yield srv


def client_of(srv, optimizer=None, **kw) -> SplitClient:
    optimizer = optimizer or srv.optimizer
    return SplitClient(srv.url, "tiny", token=TOKEN, optimizer=optimizer, lr=LR[optimizer],
                       device="cpu", **kw)


# This test must run first on each server (pytest keeps file order within a fixture param):
# the ones after it change the server's weights.
def test_split_training_equals_unsplit(server):
    with client_of(server) as client:
        assert client.u_shape == (len(server.cuts) == 2)
        losses = [client.train_step(ids, mask) for ids, mask in BATCHES[:3]]
        reference, expected = unsplit_steps(server.cuts, server.optimizer, BATCHES[:3])
        assert losses == pytest.approx(expected, abs=ATOL)
        assert_both_sides_equal(reference, client, server)
        assert client.step == 3
        # evaluation is the same loss as the unsplit model's, and changes nothing
        ids, mask = BATCHES[3]
        reference.eval()
        pos = positions_from_mask(mask, ids.shape[1])
        with torch.no_grad():
            ref_loss = reference(ids, attention_mask=mask, position_ids=pos,
                                 labels=labels_from_batch(ids, mask)).loss.item()
        assert client.evaluate(ids, mask) == pytest.approx(ref_loss, abs=ATOL)
        assert_both_sides_equal(reference, client, server)


@pytest.mark.parametrize("wire_dtype", ["int8", "bfloat16"])
def test_low_precision_wire_trains(server, wire_dtype):
    with client_of(server, wire_dtype=wire_dtype) as client:
        before = {k: v.clone() for k, v in client.bottom.state_dict().items()}
        losses = [client.train_step(ids, mask) for ids, mask in BATCHES[1:3]]
        assert all(torch.isfinite(torch.tensor(losses)))
        assert torch.isfinite(torch.tensor(client.evaluate(*BATCHES[3])))
        assert any(not torch.equal(before[k], v) for k, v in client.bottom.state_dict().items())
        # the activations really travelled narrower than float32 (B x T x d x 4 bytes per call)
        f32 = 2 * 12 * 32 * 4
        per_call = client.stats.bytes_sent / client.stats.calls
        assert per_call < f32 * (0.75 if wire_dtype == "int8" else 0.95)


def test_checkpoint_and_resume(tmp_path):
    cuts, optimizer = (1, 3), "adamw"
    srv = ServerProcess(cuts, optimizer=optimizer, lr=LR[optimizer], checkpoint_dir=tmp_path / "server")
    with srv:
        with client_of(srv, optimizer) as first:
            for ids, mask in BATCHES[:2]:
                first.train_step(ids, mask)
            first.save(tmp_path / "client")  # asks the server to checkpoint too
            client_id = first.client_id
        assert has_state(tmp_path / "client", "client") and has_state(tmp_path / "server", "server")
        shutil.rmtree(tmp_path / "server")
        srv.restart()  # SIGTERM: the server checkpoints on its way out, then starts from it
        assert has_state(tmp_path / "server", "server")

        with client_of(srv, optimizer) as resumed:  # fresh random weights until load()
            assert resumed.load(tmp_path / "client") == 2
            assert resumed.client_id == client_id
            for ids, mask in BATCHES[2:4]:
                resumed.train_step(ids, mask)
            reference, _ = unsplit_steps(cuts, optimizer, BATCHES[:4])
            assert_both_sides_equal(reference, resumed, srv)

        # the server is now at step 4 for this client; the step-2 checkpoint no longer fits
        with client_of(srv, optimizer) as stale:
            with pytest.raises(Conflict, match=r"step 2 \(journal to step 2\) but the server has applied step 4"):
                stale.load(tmp_path / "client")


def test_restart_between_forward_and_backward_redoes_the_forward(tmp_path):
    """The server dies after a U-shape forward: the client resends it; nothing is lost or doubled."""
    cuts, optimizer = (1, 3), "adamw"
    srv = ServerProcess(cuts, optimizer=optimizer, lr=LR[optimizer], checkpoint_dir=tmp_path / "server")
    with srv:
        with client_of(srv, optimizer) as client:
            client.train_step(*BATCHES[0])
            real_call = client.transport.call_meta
            restarted = []

            def call(path, tensors, meta=None, lane=0):
                if path.endswith("/backward") and not restarted:
                    restarted.append(path)
                    srv.restart()  # the pending forward is gone with the old process
                return real_call(path, tensors, meta, lane)

            client.transport.call_meta = call
            for ids, mask in BATCHES[1:3]:
                client.train_step(ids, mask)
            assert restarted and client.step == 3
            reference, _ = unsplit_steps(cuts, optimizer, BATCHES[:3])
            assert_both_sides_equal(reference, client, srv)


def test_clients_built_from_many_threads_at_once_all_work():
    """Simulating many data owners in one process: construction is thread-safe."""
    import threading

    with InprocServerProcess((1, 3), optimizer="sgd", lr=LR["sgd"]) as srv:
        built, errors = [], []

        def build(i):
            try:
                built.append(SplitClient(srv.url, "tiny", token=TOKEN, optimizer="sgd", lr=LR["sgd"],
                                         client_id=f"owner-{i}"))
            except Exception as e:  # noqa: BLE001 - the test reports every failure
                errors.append(repr(e))

        threads = [threading.Thread(target=build, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(built) == 6
        reference = built[0].bottom.state_dict()
        for c in built:  # every client holds the same seeded weights
            assert all(torch.equal(v, reference[k]) for k, v in c.bottom.state_dict().items())
            c.close()


def test_a_script_run_twice_with_one_client_id_goes_on_from_the_servers_step(server):
    """A newcomer runs the same ``SplitClient(..., client_id="rerun")`` script twice: the second
    run numbers its steps after the server's last one for that id (as the model classes do),
    instead of a 409 "step 1 ... is out of order: the server has applied step 2"."""
    for run in range(2):
        with client_of(server, client_id="rerun") as client:
            assert client.step == 2 * run
            for ids, mask in BATCHES[:2]:
                client.train_step(ids, mask)
            assert client.step == 2 * run + 2
