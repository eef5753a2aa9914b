"""Locust users for the load test: each user is one data owner (a tenant) of a U-shape server.

    locust -f benchmarks/locustfile.py --headless -u 4 -r 4 -t 60s --host http://127.0.0.1:8000 \\
        --token-file tokens.txt [--client-ids a,b,c,d] --csv /tmp/load

(``benchmarks/load.py`` starts the server or the cluster, runs this and reads the CSVs.)
User i takes line ``i mod N`` of the server's ``--token-file`` (docs/SECURITY.md: ``<name>
<token>``) and the client id ``--client-ids[i mod N]`` (default ``owner``: a client id is
scoped by its tenant). The users speak the raw protocol of docs/PROTOCOL.md with random
activations (the server's work only: no client model runs here), tensors as safetensors
(:func:`splitlearn.api.wire.encode`), and pick by weight between two tasks, back to back (no
think time: the load is as much as N owners can send):

- ``generate`` (``--gen-weight``): ``POST /v1/sessions`` {rows 1, client_id} -> ``prefill``
  (``--prompt-tokens`` positions) -> ``--new-tokens`` x ``decode`` (1 position each) ->
  ``DELETE`` (``close``);
- ``train`` (``--train-weight``): one training step of ``--batch`` x ``--seq`` positions
  (``micros=0``: ``train forward``, ``train backward``, then ``train apply`` at lr 1e-4).

Every request is one row of Locust's statistics under the operation's name; an answer other
than the expected status, or whose tensor has the wrong shape, is a failure. ``--report-json``
writes the final statistics once the users have stopped (Locust's ``--csv`` files are
rewritten once a second, so they can miss the run's last second). Every request
carries ``X-Splitlearn-Route`` so that behind the cluster's HAProxy one owner's sessions and
steps reach one replica.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import gevent
import torch
from locust import FastHttpUser, constant, events, task

from splitlearn.api import protocol as P
from splitlearn.api.wire import decode, encode, pack

WIRE = "float32"
OCTET = {"Content-Type": P.CONTENT_TYPE}


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--token-file", default="", help="the server's token file: one owner per line")
    parser.add_argument("--client-ids", default="", help="comma-separated, one per owner (default: 'owner')")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4, help="training rows")
    parser.add_argument("--seq", type=int, default=64, help="training positions per row")
    parser.add_argument("--gen-weight", type=int, default=1)
    parser.add_argument("--train-weight", type=int, default=1)
    parser.add_argument("--report-json", default="", help="write the per-operation figures here at the end")


@events.init.add_listener
def _fresh_clock(environment, **_) -> None:
    """``-t`` is a gevent timer, measured from the event loop's cached clock, which stands
    still while this file imports torch (seconds): without a refresh the run ends early."""
    gevent.get_hub().loop.update_now()


@events.test_stop.add_listener
def _report(environment, **_) -> None:
    """Per operation: requests, failures, p50/p99 (Locust's own percentiles, ms; whole ms
    below 100 ms), requests/s; the failures' messages and the tasks' exceptions."""
    path = environment.parsed_options.report_json
    if not path:
        return
    stats = environment.stats
    ops = [{"op": e.name, "method": e.method, "requests": e.num_requests, "failures": e.num_failures,
            "p50_ms": e.get_response_time_percentile(0.5), "p99_ms": e.get_response_time_percentile(0.99),
            "max_ms": e.max_response_time, "rps": e.total_rps}
           for e in sorted(stats.entries.values(), key=lambda e: e.name)]
    errors = [{"op": e.name, "error": str(e.error), "count": e.occurrences} for e in stats.errors.values()]
    exceptions = [{"error": x["msg"], "count": x["count"]} for x in environment.runner.exceptions.values()]
    Path(path).write_text(json.dumps({"ops": ops, "errors": errors, "exceptions": exceptions}, indent=1) + "\n")


def owners(opts) -> list[tuple[str, str]]:
    """(token, client id) per owner, in the token file's order."""
    tokens = [P.parse_token_line(line)[1] for line in P.read_token_file(opts.token_file)]
    ids = [c for c in opts.client_ids.split(",") if c] or ["owner"] * len(tokens)
    if len(ids) != len(tokens):
        raise SystemExit(f"--client-ids names {len(ids)} owners, the token file {len(tokens)}")
    return list(zip(tokens, ids))


class Owner(FastHttpUser):
    wait_time = constant(0)
    _next = itertools.count()

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.opts = opts
        mine = owners(opts)
        self.token, self.cid = mine[next(Owner._next) % len(mine)]
        self.auth = {"Authorization": f"Bearer {self.token}",
                     P.ROUTE_HEADER: P.route_key(self.token, self.cid)}
        info = self.client.get(P.INFO, headers=self.auth, name="info").json()
        if info["shape"] != "u":
            raise SystemExit("the load test speaks the U-shape protocol: start the server with two --cut")
        self.d = info["model_config"]["n_embd"]
        self.step = self.client.get(P.CLIENT_STATE.format(client_id=self.cid), headers=self.auth,
                                    name="client state").json()["step"]
        # the weights come from the command line, after @task read the class: Locust draws
        # uniformly from the user's ``tasks`` list, so repeat each task by its weight
        self.tasks = [Owner.generate] * opts.gen_weight + [Owner.train] * opts.train_weight

    # -- one request -----------------------------------------------------------------------

    def _post(self, name: str, path: str, expect: int, body: bytes = b"", json_body=None,
              shape: tuple | None = None, out: str = P.HIDDEN):
        """POST, check the status (and the answer tensor's shape); the answer, or None."""
        kw = {"json": json_body} if json_body is not None else {"data": body}
        headers = self.auth if json_body is not None else {**self.auth, **OCTET}
        with self.client.post(path, name=name, headers=headers, catch_response=True, **kw) as r:
            if r.status_code != expect:
                r.failure(f"{r.status_code}: {(r.text or '')[:300]}")
                return None
            if shape is not None:
                got = tuple(decode(r.content)[0][out].shape)
                if got != shape:
                    r.failure(f"answer {out} of shape {got}, expected {shape}")
                    return None
            r.success()
            return r

    def _hidden(self, rows: int, t: int, meta: dict, name: str = P.HIDDEN) -> bytes:
        return encode(pack(name, torch.randn(rows, t, self.d), WIRE), {**meta, "wire_dtype": WIRE})

    # -- tasks -----------------------------------------------------------------------------

    @task
    def generate(self) -> None:
        o = self.opts
        r = self._post("session open", P.SESSIONS, 201, json_body={"rows": 1, "client_id": self.cid})
        if r is None:
            return
        sid = r.json()["session_id"]
        path = P.SESSION_STEP.format(session_id=sid)
        ok = self._post("prefill", path, 200, self._hidden(1, o.prompt_tokens, {"position": "0"}),
                        shape=(1, o.prompt_tokens, self.d))
        for i in range(o.new_tokens if ok else 0):
            if self._post("decode", path, 200, self._hidden(1, 1, {"position": str(o.prompt_tokens + i)}),
                          shape=(1, 1, self.d)) is None:
                break
        with self.client.delete(P.SESSION.format(session_id=sid), headers=self.auth, name="close",
                                catch_response=True) as r:
            r.success() if r.status_code == 204 else r.failure(f"{r.status_code}: {(r.text or '')[:300]}")

    @task
    def train(self) -> None:
        o, step = self.opts, self.step + 1
        meta = {"client_id": self.cid, "step": str(step), "micro": "0", "micros": "0"}
        shape = (o.batch, o.seq, self.d)
        if self._post("train forward", P.TRAIN_FORWARD, 200, self._hidden(o.batch, o.seq, meta),
                      shape=shape) is None:
            return
        if self._post("train backward", P.TRAIN_BACKWARD, 200, self._hidden(o.batch, o.seq, meta, P.GRAD),
                      shape=shape, out=P.GRAD) is None:
            return
        if self._post("train apply", P.TRAIN_APPLY, 200, json_body={
                "client_id": self.cid, "step": step, "pieces": 1, "lr": 1e-4}) is None:
            return
        self.step = step
