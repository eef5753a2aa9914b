"""kill -9 of the server at any moment: the client recovers by itself, bit-identical (float32 wire).

Each test trains one run undisturbed and one with the server killed (SIGKILL) and restarted
from its checkpoint directory, and compares every loss and every weight exactly. The killed
server is a real process; the undisturbed runs' server is the same app in this process
(tests/serverproc.py's InprocServerProcess: the same answers, bit for bit).
"""
import os
import threading
import time

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.client import SplitClient
from splitlearn.errors import TransportError

from serverproc import TOKEN, InprocServerProcess, ServerProcess, web
from test_client import LR

pytestmark = pytest.mark.slow

STEPS = 12


def batches(n=STEPS):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 256, (2, 10), generator=g), None) for _ in range(n)]


def run(cuts, tmp, *, every=5, kill_after=None, kill_in_backward=False, reconnect_timeout_s=60.0):
    """Train STEPS steps; kill -9 the server after step ``kill_after`` (or during the backward
    of the next step); restart it at once (it is down until the new process answers). Returns
    (losses, client weights, server weights).
    Undisturbed (no ``kill_after``), the server runs in this process."""
    server = ServerProcess if kill_after is not None else InprocServerProcess
    srv = server(cuts, optimizer="adamw", lr=LR["adamw"], checkpoint_dir=tmp, extra=["--checkpoint-every", str(every)])
    with srv:
        client = SplitClient(srv.url, "tiny", token=TOKEN, optimizer="adamw", lr=LR["adamw"], device="cpu",
                             client_id="c", reconnect_timeout_s=reconnect_timeout_s, retries=1)
        losses = []

        def crash():
            srv.kill()
            threading.Thread(target=srv.start, daemon=True).start()  # (its start waits until it answers)

        if kill_in_backward:
            real = client.transport.call_meta

            def call(path, tensors, meta=None, lane=0):
                if path == P.TRAIN_BACKWARD and client.step == kill_after and not crashed:
                    crashed.append(1)
                    crash()
                return real(path, tensors, meta, lane)

            crashed = []
            client.transport.call_meta = call
        for i, (ids, mask) in enumerate(batches()):
            if i == kill_after and not kill_in_backward:
                crash()
            losses.append(client.train_step(ids, mask))
        client.flush()  # the last step's deferred apply, now (not raced by a sleep against apply_wait_s)
        weights = {k: v.clone() for s in client.segments for k, v in s.hf_state_dict().items()}
        server = srv.weights()
        client.close()
    if kill_after is not None:
        # the server had applied kill_after - 1 steps (the last one's apply rides on the next step's
        # first request) and checkpointed the last multiple of ``every`` of those; the steps after it,
        # the pending one included, are lost: the client must have noticed and replayed exactly those
        lost = kill_after - ((kill_after - 1) // every) * every
        assert client.recoveries and client.recoveries[0]["replayed"] == lost, client.recoveries
    return losses, weights, server


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return {cuts: run(cuts, tmp_path_factory.mktemp("ref")) for cuts in [(1, 3), (2,)]}


def assert_identical(a, b):
    assert a[0] == b[0]  # every loss, bit for bit
    for x, y in ((a[1], b[1]), (a[2], b[2])):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
@pytest.mark.parametrize("kill_after", [7, 10], ids=["between-checkpoints", "right-after-a-checkpoint"])
def test_server_killed_between_steps(reference, tmp_path, cuts, kill_after):
    assert_identical(run(cuts, tmp_path, kill_after=kill_after), reference[cuts])


def test_server_killed_between_a_u_shape_forward_and_its_backward(reference, tmp_path):
    assert_identical(run((1, 3), tmp_path, kill_after=8, kill_in_backward=True), reference[(1, 3)])


def test_checkpoint_every_step_and_a_stale_partial_checkpoint(reference, tmp_path):
    """A save killed half-way leaves a .tmp generation: the restarted server ignores it."""
    (tmp_path / "server-99999999.tmp").mkdir(parents=True)
    (tmp_path / "server-99999999.tmp" / "weights.safetensors").write_bytes(b"\x00" * 64)
    assert_identical(run((1, 3), tmp_path, every=1, kill_after=5), reference[(1, 3)])


def test_the_client_gives_up_after_the_reconnect_window(tmp_path):
    srv = ServerProcess((1, 3), checkpoint_dir=tmp_path)
    with srv:
        client = SplitClient(srv.url, "tiny", token=TOKEN, device="cpu", reconnect_timeout_s=1.0, retries=0)
        client.train_step(*batches()[0])
        srv.kill()
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="did not come back within 1s"):
            client.train_step(*batches()[1])
        assert time.monotonic() - t0 < 30


def test_a_corrupt_checkpoint_stops_the_server_naming_the_file(tmp_path):
    srv = ServerProcess((1, 3), checkpoint_dir=tmp_path)
    with srv:
        with SplitClient(srv.url, "tiny", token=TOKEN, device="cpu") as c:
            c.train_step(*batches()[0])
    gen = sorted(tmp_path.glob("server-*"))[-1]
    weights = gen / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    import subprocess
    import sys

    from splitlearn.procs import localserver

    # a real server process (its exit code is the point), forked from the tests' preloaded
    # interpreter as the servers are (tests/forkserver.py: not ~9 CPU-seconds of imports)
    env = {**os.environ, "SPLITLEARN_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "stderr", "w") as err:
        proc = localserver.launch([sys.executable, "-m", "splitlearn.server", "--model", "tiny", "--cut", "1",
                                   "--cut", "3", "--checkpoint-dir", str(tmp_path), "--port", "9"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=err)
        code = proc.wait(120)
    stderr = (tmp_path / "stderr").read_text()
    assert code == 2 and str(weights) in stderr and "corrupt" in stderr, (code, stderr[-3000:])


def cli_args(srv, steps, *extra) -> list[str]:
    return ["train", "--server", srv.url, "--model", "tiny", "--steps", str(steps), "--batch-size", "2",
            "--seq-len", "12", "--lr", "0.01", "--device", "cpu", "--client-id", "owner", "--quiet", "--json",
            *extra]


def cli_train(srv, steps, *extra, logs):
    """``python -m splitlearn.client train ...`` as a process of its own, forked from the tests'
    preloaded interpreter where it can be, as the servers are (tests/forkserver.py: not ~9
    CPU-seconds of imports each); its stdout and stderr go to the files ``logs``.out and .err."""
    import sys

    from splitlearn.procs import localserver

    env = {**os.environ, "SPLITLEARN_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    logs.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{logs}.out", "w") as out, open(f"{logs}.err", "w") as err:
        return localserver.launch([sys.executable, "-m", "splitlearn.client", *cli_args(srv, steps, *extra)],
                                  env=env, stdout=out, stderr=err)


def test_a_client_killed_mid_training_resumes_exactly(tmp_path, monkeypatch):
    """kill -9 of the client CLI after a few steps; `train --resume` ends where an undisturbed run
    ends. The killed client and its server are real processes; the resumed run is the same command
    in this process (what it reads is what the killed process left on disk and on the server), and
    so is the undisturbed run, against the same app (InprocServerProcess). U-shape: the 2-way
    client's journal is the same code (tests/test_hf_journal.py kills model classes of both shapes)."""
    import signal

    from splitlearn.client.cli import main

    cuts, results = (1, 3), {}
    for name in ("undisturbed", "killed"):
        d = tmp_path / name
        server = ServerProcess if name == "killed" else InprocServerProcess
        with server(cuts, checkpoint_dir=d / "server", extra=["--checkpoint-every", "4"]) as srv:
            save = d / "client"
            if name == "undisturbed":
                monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
                assert main(cli_args(srv, 14, "--save", str(save))) == 0
            else:
                proc = cli_train(srv, 14, "--save", str(save), logs=d / "first")
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:  # wait until it is mid-way (its log has steps)
                    wal = list((save / "wal").glob("*.safetensors")) if (save / "wal").exists() else []
                    if len(wal) >= 2 and requests_step(srv) >= 6:
                        break
                    time.sleep(0.02)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                assert proc.returncode == -signal.SIGKILL
                monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
                assert main(cli_args(srv, 14, "--resume", str(save))) == 0
            assert requests_step(srv) == 14
            results[name] = (srv.weights(), read_client(save))
    (sa, ca), (sb, cb) = results["undisturbed"], results["killed"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa) and all(torch.equal(ca[k], cb[k]) for k in ca)


def requests_step(srv) -> int:
    r = web.get(srv.url + P.CLIENT_STATE.format(client_id="owner"), headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=10)
    return r.json()["step"]


def read_client(save):
    from splitlearn.model.checkpoint import read_weights

    return read_weights(save, "client")
