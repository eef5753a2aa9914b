"""A replica that restarts and takes its owners back serves their newest state to reads too.

The attack (docs/CLUSTER.md, "Per-client LoRA on a frozen base: failover"): replica A dies
(kill -9) after an owner's durable step 3 and step 4 in memory; the owner moves to B, which
loads step 3, gets step 4 replayed from the client's journal and trains steps 5..8 (step 6
durable: ``--checkpoint-every 3``). A comes back and HAProxy moves the owner back to it: A
loads step 6 from the shared state directory; steps 7 and 8 are only on B and in the client's
journal. Training would replay them at its next step (a 409), but a *read* in between (the
adapter, an export, ``evaluate``, ``generate``) read step 6's weights: "kill -9 loses nothing"
broken for everything but training (the real cluster's kill test failed so 1 run in 2 when the
killed replica came back within a second). The client now brings a server that is behind its last
applied step up to it before such a read (``Recovery.current``, splitlearn/hf/recovery.py).

In process: two segment apps sharing one ``--state-dir``, served in turn at one ``inproc://``
URL (what HAProxy's ring does for this owner), a "kill" being the URL's app dropped without
its SIGTERM save; the reference is one server with no restart.
"""
from __future__ import annotations

import torch

from splitlearn.api import protocol as P
from splitlearn.client import SplitClient
from splitlearn.hf.lora import fetch_server_adapter
from splitlearn.transport.inproc import serve_inproc, unserve

from serverproc import TOKEN, InprocServer

LORA = ["--lora-r", "4", "--lora-alpha", "8", "--lora-targets", "c_attn,c_proj"]
ARGS = ["--model", "tiny", "--cut", "1", "--cut", "3", "--optimizer", "adamw", "--lr", "0.01", "--threads", "2",
        "--checkpoint-every", "3", *LORA]
STEPS = 8


def client(url: str) -> SplitClient:
    return SplitClient(url, "tiny", token=TOKEN, optimizer="adamw", lr=1e-2, device="cpu", client_id="o1",
                       lora="server", reconnect_timeout_s=10, retries=0, poll_idle=False)


def same(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_an_owner_moved_back_to_a_restarted_replica_reads_its_newest_state(tmp_path):
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 256, (2, 10), generator=g) for _ in range(STEPS + 1)]
    prompt = data[STEPS][:1, :5]

    def reads(cl: SplitClient) -> list:
        """What a user reads of the server's state of this owner: the adapter (after flush(), as
        export_adapter reads it), an evaluation, a generation."""
        return [lambda: (cl.flush(), fetch_server_adapter(cl.transport, cl.client_id))[1],
                lambda: cl.evaluate(data[STEPS]), lambda: cl.generate(prompt, max_new_tokens=4)]

    with InprocServer(ARGS) as one, client(one.url) as cl:  # the reference: one server, nothing restarted
        for b in data[:STEPS]:
            cl.train_step(b)
        want = [read() for read in reads(cl)]

    apps = []  # every app this test built (closed at the end)

    def serve(url=None) -> str:
        """A replica's (re)start on the shared state directory, served where the owner's route
        reaches (``url``: HAProxy moving the owner to it; the previous app there: dead, or alive
        with the owner routed away)."""
        srv = InprocServer([*ARGS, "--state-dir", str(tmp_path / "state")])
        apps.append(srv.build())
        if url is not None:
            unserve(url, timeout_s=30)  # no SIGTERM save: kill -9, or simply routed away
        return serve_inproc(apps[-1], None if url is None else url.split("://", 1)[1])

    url = serve()
    cl = client(url)
    try:
        for b in data[:4]:  # steps 1..4 on A; 3 is durable
            cl.train_step(b)
        cl.flush()
        serve(url)  # A killed: the owner moves to B, which loads step 3 (the journal replays 4)
        for b in data[4:STEPS]:  # 5..8 on B, 6 durable
            cl.train_step(b)
        assert cl.recoveries and same(reads(cl)[0](), want[0])  # nothing lost while on B
        for i, read in enumerate(reads(cl)):
            serve(url)  # A back (each time anew): it takes the owner back and loads step 6
            got = read()
            assert (same(got, want[i]) if i == 0 else torch.equal(torch.as_tensor(got), torch.as_tensor(want[i]))), \
                f"read {i} after the restart saw the last durable step, not the last applied one"
            assert cl.transport.get_json(P.CLIENT_STATE.format(client_id=cl.client_id))["step"] == STEPS
    finally:
        cl.close()
        for app in apps:
            app.extensions["splitlearn"].compute.close()
