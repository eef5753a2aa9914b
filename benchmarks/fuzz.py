"""Fuzz a real server with schemathesis, from the OpenAPI document it serves.

    python benchmarks/fuzz.py                       # both shapes, 60 examples per operation and mode
    python benchmarks/fuzz.py --examples 10 --json out.json

For each shape (U-shape cuts 1,3 and 2-way cut 2) a ``python -m splitlearn.server --model tiny``
child with two tenants: ``operator`` (who watches) and ``fuzzer`` (whose token every generated
request carries). schemathesis loads ``GET /v1/openapi.json`` and, per operation, generates
``--examples`` schema-valid requests and as many schema-invalid ones (its negative mode). The
safetensors bodies come from :func:`safetensors_bodies`, registered as the strategy of
``application/octet-stream``: random bytes, or well-formed safetensors whose tensors and
metadata are the protocol's names with plausible and implausible shapes, dtypes and values
(random bytes alone never get past the decoder). A session id is, half the time, one of the
fuzzer's open sessions. Every answer must pass schemathesis' checks (no 5xx; status, content
type, headers and JSON body as documented; schema-invalid data rejected), and after every 4xx
the server's state must be as before: ``/v1/info``'s counters (steps applied, sessions, decode
steps, memory reserved), the federation's version and round, the fuzzer's clients' steps,
and the digest of the segment's weights and optimizer state (a checkpoint by the operator).

Then two stateful parts, so that the answers a lone request never gets (409, 413, 429) are
reached and checked too:

- :func:`stateful`: schemathesis' state machine over the document's OpenAPI links (open a
  session -> step -> step ... -> close; ``--stateful-examples`` scenarios of up to 8 calls).
  A model of the server (each session's rows and positions seen) makes half of the steps
  valid, so the next step at a stale position is a real conflict (409); the same checks, and
  the same state comparison after every 4xx.
- :func:`hostile`: targeted sequences. Training, as a client runs it: forward -> backward
  (U-shape; a fused ``/v1/train/step`` in the 2-way shape) -> apply; then requests that must
  answer **400** (a closed step, ``micros >= 1``: gone), **409** (a step out of order, a backward
  with no forward pending, an apply of no pending step, a session step at a stale position or
  out of its numbering), **413** (a body over ``--max-body-mb``; a forward whose working
  memory is over ``--max-request-memory-gb``) and **429** (a session over
  ``--max-sessions-per-tenant``, with ``Retry-After``), each with the documented JSON body
  ``{"error", "message"}`` (its code one of the status's in the document) and nothing changed
  (the same state as above, the weights' digest included).

The fuzzed server runs with small limits (``--max-body-mb 4 --max-request-memory-gb 0.004``)
so that hostile requests stay small. Reported: requests sent, by status, and every failure
with a curl line to reproduce it. tests/test_openapi.py runs all three briefly (a few seconds
of fuzzing); ``make fuzz`` runs them long.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import requests  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

import schemathesis  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from splitlearn.api import openapi  # noqa: E402
from splitlearn.api import protocol as P  # noqa: E402
from splitlearn.procs.localserver import LocalServer  # noqa: E402
from splitlearn.api.wire import decode, encode  # noqa: E402

SHAPES = {"u": ("1", "3"), "2-way": ("2",)}
OPERATOR, FUZZER = "op-7d2c91e04b5a63f8", "fz-3a8e50c17d96b2e4"
CLIENT_IDS = ("c1", "c2")  # the fuzzer's clients: steps 1..3 of these can really be applied
SMALL_LIMITS = ("--max-body-mb", "4", "--max-request-memory-gb", "0.004")  # hostile requests stay small
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance", "negative_data_rejection")


# -- bodies ---------------------------------------------------------------------------------

def safetensors_bodies(info: dict) -> st.SearchStrategy[bytes]:
    """Bodies for any tensor route of the server ``info`` describes: 1 in 8 random bytes, the
    rest safetensors with the protocol's tensor names and metadata keys (dtypes, shapes and
    values mostly right, sometimes wrong: NaN, out of range, off by one)."""
    d, vocab = info["model_config"]["n_embd"], info["model_config"]["vocab_size"]
    names = [P.HIDDEN, P.MASK, P.LABELS, P.GRAD, P.REORDER, "hidden.scale", "x.0", "y", "transformer.wte.weight"]
    ints = st.one_of(st.integers(0, 4), st.integers(-2, 1 << 20).map(str)).map(str)
    meta = st.fixed_dictionaries({}, optional={
        "client_id": st.sampled_from([*CLIENT_IDS, "", "bad id", "x" * 65]),
        "step": ints, "micro": ints, "micros": ints, "position": ints, "crop": ints, "logits": st.sampled_from(["0", "1", "all", "-1", "x"]),
        "wire_dtype": st.sampled_from(["float32", "bfloat16", "float16", "int8", "float64", ""]),
        "fed_version": ints, "loss_scale": st.sampled_from(["1", "0.5", "0", "nan", "2"]), "samples": ints,
        "padding": st.just("any"), "layers": st.sampled_from(["h.0.mlp.c_fc", "lm_head", "nope"]),
        "scheme": st.sampled_from(["masked", "plain", "x"]), "ticket": st.text(max_size=8)})

    @st.composite
    def tensor(draw, name: str):
        B, T = draw(st.integers(1, 3)), draw(st.integers(1, 6))
        if name in (P.MASK, P.LABELS, P.REORDER):
            shape = (B,) if name == P.REORDER else (B, T)
            hi = {P.MASK: 2, P.LABELS: vocab, P.REORDER: B}[name]
            lo = -100 if name == P.LABELS else 0
            t = torch.randint(lo, hi + draw(st.integers(0, 1)), shape)
            return t.clamp(min=0) if name == P.MASK else t
        shape = draw(st.sampled_from([(B, T, d), (B, T, d), (B, T, d + 1), (1,), (B, T), (0, T, d)]))
        dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]))
        t = torch.randn(shape) if dtype.is_floating_point or dtype == torch.float32 else torch.randint(-5, 5, shape)
        if t.numel() and draw(st.integers(0, 9)) == 0:
            t.view(-1)[0] = float("nan") if t.is_floating_point() else 7
        return t.to(dtype)

    @st.composite
    def body(draw) -> bytes:
        chosen = draw(st.lists(st.sampled_from(names), min_size=0, max_size=4, unique=True))
        tensors = {n: draw(tensor(n)) for n in chosen}
        data = encode(tensors, draw(meta)) if tensors else b""
        if data and draw(st.integers(0, 9)) == 0:  # truncated
            data = data[: draw(st.integers(0, len(data) - 1))]
        return data

    return st.one_of(st.binary(max_size=64), body(), body(), body(), body(), body(), body(), body())


# -- state ------------------------------------------------------------------------------------

def schema_problems(case, resp, checks, headers) -> list[str]:
    """schemathesis' verdict on one answer: the first line of its failure, or nothing."""
    try:
        case.validate_response(resp, checks=checks, headers=headers)
    except Exception as e:  # noqa: BLE001 - schemathesis' failures, collected
        return [str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__]
    return []


def changed(before: dict, after: dict, status: int) -> list[str]:
    """A problem if the server's state moved across a 4xx answer."""
    if after == before:
        return []
    return [f"state changed after {status}: "
            f"{ {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)} }"]


_READS = requests.Session()  # state()'s reads


def _memory(info: dict) -> dict:
    return {k: info.get("memory", {}).get(k) for k in ("reserved_bytes", "tenant_reserved_bytes")}


def state(url: str, checkpoint: bool, operator: str = OPERATOR, tenant: str = FUZZER,
          settled: Optional[dict] = None) -> dict:
    """What a refused request must leave as it was: the server-wide counters (as the ``operator``
    sees them: a tenant's ``/v1/info`` shows its own only), the fuzzing ``tenant``'s federation and
    client states, and (``checkpoint``) the digest of a checkpoint by the ``operator``.
    ``settled``: memory figures (a state's ``"memory"``) read settled before, if any."""
    op, fz = {"Authorization": f"Bearer {operator}"}, {"Authorization": f"Bearer {tenant}"}
    reads = _READS  # one kept-alive connection for the reads (not a new one each: ~5 per state)
    info = reads.get(url + P.INFO, headers=op, timeout=30).json()  # server-wide: a tenant sees its own only
    # a request's body reservation is released when its answer's connection is done with it, a
    # moment after the client read the answer: the memory figures are read until two reads 50 ms
    # apart agree (a reservation that stays is still a change; one being released is not). A first
    # read equal to figures read settled before (the state before the request) is settled already:
    # a reservation still held would add to them, and a release only takes away, so there is
    # nothing to wait for (most reads: ~50 ms less each)
    for _ in range(0 if settled is not None and _memory(info) == settled else 40):
        time.sleep(0.05)
        again = reads.get(url + P.INFO, headers=op, timeout=30).json()
        if again.get("memory") == info.get("memory"):
            break
        info = again
    fed = reads.get(url + P.FEDERATION, headers=fz, timeout=30).json()
    out = {"steps_applied": info["steps_applied"], "sessions": info["generation"]["sessions"],
           "decode_steps": info["generation"]["decode_steps"],
           "memory": _memory(info),
           "federation": {k: fed.get(k) for k in ("version", "round", "members", "synced", "turn")},
           "clients": {c: reads.get(url + P.CLIENT_STATE.format(client_id=c), headers=fz, timeout=30).json()["step"]
                       for c in CLIENT_IDS}}
    if checkpoint:
        saved = Path(reads.post(url + P.CHECKPOINT, headers=op, timeout=30).json()["saved"])
        if not (saved / "weights.safetensors").exists():  # the checkpoint root: its newest directory
            saved = sorted(saved.glob("server-*"))[-1]
        h = hashlib.sha256()
        for f in sorted(saved.iterdir()):  # weights, optimizer state, step counters
            h.update(f.name.encode() + f.read_bytes())
        out["weights"] = h.hexdigest()
    return out


@dataclass
class Report:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    by_operation: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"requests": self.requests, "statuses": dict(sorted(self.statuses.items())),
                "by_operation": dict(self.by_operation), "failures": self.failures, "skipped": self.skipped}


# -- the run ----------------------------------------------------------------------------------

def fuzz(url: str, examples: int, *, operator: str = OPERATOR, tenant: str = FUZZER,
         modes=(GenerationMode.POSITIVE, GenerationMode.NEGATIVE)) -> Report:
    """schemathesis against the server at ``url`` with the ``tenant``'s token: ``examples``
    requests per operation and generation mode; every failure goes to the report. The weights'
    digest (a checkpoint by the ``operator``: ~65 ms) is compared around the 4xx of POST
    routes, the only ones that run the model."""
    report = Report()
    fz = {"Authorization": f"Bearer {tenant}"}
    info = requests.get(url + P.INFO, headers=fz, timeout=30).json()
    schemathesis.openapi.media_type(P.CONTENT_TYPE, safetensors_bodies(info))
    schema = schemathesis.openapi.from_url(url + P.OPENAPI, headers=fz)
    http = requests.Session()
    sessions = [requests.post(url + P.SESSIONS, json={"rows": 1}, headers=fz, timeout=30).json()["session_id"]
                for _ in range(2)]
    checks = [getattr(schemathesis.checks, name) for name in CHECKS]
    cached: dict = {}
    last: dict = {}  # the memory figures of the last state read (settled)

    for result in schema.get_all_operations():
        op = result.ok()
        for mode in modes:
            try:
                strategy = op.as_strategy(generation_mode=mode)
            except Exception as e:  # noqa: BLE001 - an operation schemathesis cannot negate
                report.skipped.append(f"{op.label} {mode.value}: {type(e).__name__}: {e}")
                continue

            @settings(max_examples=examples, database=None, deadline=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=strategy, pick=st.integers(0, 3))
            def one(case, pick):
                if "session_id" in (case.path_parameters or {}) and pick < len(sessions):
                    case.path_parameters["session_id"] = sessions[pick]
                weights = op.method.upper() == "POST"
                before = cached.pop("state", None)  # the state after the last 4xx, if nothing ran since
                if before is None or (weights and "weights" not in before):
                    before = state(url, weights, operator, tenant, last.get("memory"))
                    last["memory"] = before["memory"]
                elif not weights:
                    before.pop("weights", None)
                resp = case.call(base_url=url, session=http, headers=fz, timeout=60)
                report.requests += 1
                report.statuses[resp.status_code] += 1
                report.by_operation[op.label] += 1
                problems = schema_problems(case, resp, checks, fz)
                if 400 <= resp.status_code < 500:
                    after = state(url, weights, operator, tenant, before["memory"])
                    last["memory"] = after["memory"]
                    problems += changed(before, {k: v for k, v in after.items() if k in before}, resp.status_code)
                    cached["state"] = after
                elif op.label == f"POST {P.SESSIONS}" and resp.status_code == 201:
                    http.delete(url + P.SESSION.format(session_id=resp.json()["session_id"]), headers=fz, timeout=30)
                if problems:
                    report.failures.append({"operation": op.label, "mode": mode.value, "status": resp.status_code,
                                            "problems": problems, "answer": resp.text[:300],
                                            "curl": case.as_curl_command(headers=fz)[:600]})

            try:
                one()
            except Unsatisfiable:  # nothing to negate (no parameters, no body)
                report.skipped.append(f"{op.label} {mode.value}: nothing schemathesis can generate")
    return report


# -- stateful: schemathesis over the document's links --------------------------------------

def stateful(url: str, examples: int, *, operator: str = OPERATOR, tenant: str = FUZZER, steps: int = 8,
             report: Optional[Report] = None) -> Report:
    """schemathesis' state machine over the OpenAPI links of the sessions' routes (open ->
    step -> ... -> close): ``examples`` scenarios of up to ``steps`` calls, with the
    ``tenant``'s token. Half of the steps of a session it knows are made valid (its rows, the
    positions it has seen), so the fuzzer's own steps meet a session with a history; every
    answer passes :data:`CHECKS`, and every 4xx leaves the state as it was."""
    import random

    from hypothesis.stateful import run_state_machine_as_test

    report = report if report is not None else Report()
    fz = {"Authorization": f"Bearer {tenant}"}
    info = requests.get(url + P.INFO, headers=fz, timeout=30).json()
    d = info["model_config"]["n_embd"]
    schemathesis.openapi.media_type(P.CONTENT_TYPE, safetensors_bodies(info))
    schema = schemathesis.openapi.from_url(url + P.OPENAPI, headers=fz).include(path_regex="^/v1/sessions")
    http = requests.Session()
    checks = [getattr(schemathesis.checks, name) for name in CHECKS]
    rng = random.Random(0)
    sessions: dict[str, list[int]] = {}  # session id -> [rows, positions seen]: the model of the server
    opened: set[str] = set()
    last: dict = {}  # the memory figures of the last state read (settled)
    Machine = schema.as_state_machine()

    class Watched(Machine):  # type: ignore[misc, valid-type]
        def setup(self):
            self.mine = []  # the sessions this scenario opened: closed at its end

        def teardown(self):
            for sid in self.mine:
                http.delete(url + P.SESSION.format(session_id=sid), headers=fz, timeout=30)
                sessions.pop(sid, None)
                opened.discard(sid)

        def before_call(self, case):
            self.before = state(url, False, operator, tenant, last.get("memory"))
            last["memory"] = self.before["memory"]
            sid = (case.path_parameters or {}).get("session_id")
            draw = rng.random()
            if case.operation.label == f"POST {P.SESSION_STEP}" and sid in sessions and draw < 0.7:
                rows, seen = sessions[sid]  # a valid step; 2 in 7 at a stale position instead (409)
                position = seen if draw < 0.5 else max(seen + rng.choice((-2, -1, 1)), 0) + (seen == 0)
                case.body = encode({P.HIDDEN: torch.randn(rows, rng.randint(1, 3), d)},
                                   P.SessionStepMeta(position).to_meta())
                case.media_type = P.CONTENT_TYPE

        def get_call_kwargs(self, case):
            return {"base_url": url, "session": http, "headers": fz, "timeout": 60}

        def after_call(self, response, case):
            report.requests += 1
            report.statuses[response.status_code] += 1
            report.by_operation["stateful " + case.operation.label] += 1
            sid = (case.path_parameters or {}).get("session_id")
            if case.operation.label == f"POST {P.SESSIONS}" and response.status_code == 201:
                body = response.json()
                sessions[body["session_id"]] = [body["rows"], 0]
                opened.add(body["session_id"])
                self.mine.append(body["session_id"])
            elif case.operation.label == f"POST {P.SESSION_STEP}" and response.status_code == 200 and sid in sessions:
                hidden = decode(response.content)[0].get(P.HIDDEN)  # (B, new positions, d)
                sessions[sid][1] += hidden.shape[1] if hidden is not None else 0
            elif case.operation.label == f"DELETE {P.SESSION}" and response.status_code == 204:
                sessions.pop(sid, None)

        def validate_response(self, response, case, **kwargs):
            problems = schema_problems(case, response, checks, fz)
            if 400 <= response.status_code < 500:
                after = state(url, False, operator, tenant, self.before["memory"])
                last["memory"] = after["memory"]
                problems += changed(self.before, after, response.status_code)
            if problems:
                report.failures.append({"operation": "stateful " + case.operation.label, "mode": "stateful",
                                        "status": response.status_code, "problems": problems,
                                        "answer": response.text[:300],
                                        "curl": case.as_curl_command(headers=fz)[:600]})

    try:
        run_state_machine_as_test(Watched, settings=settings(
            max_examples=examples, stateful_step_count=steps, database=None, deadline=None, derandomize=True,
            phases=[Phase.generate], suppress_health_check=list(HealthCheck)))
    finally:
        for sid in opened:  # what the scenarios left open
            http.delete(url + P.SESSION.format(session_id=sid), headers=fz, timeout=30)
    return report


# -- hostile: targeted sequences that must answer 409, 413, 429 ------------------------------

def hostile(url: str, *, operator: str = OPERATOR, tenant: str = FUZZER, client_id: str = "h1",
            report: Optional[Report] = None) -> Report:
    """Training and sessions as a client runs them, then requests that must be refused with
    409, 413 or 429 (see the module docstring): each answer's status, its JSON body (exactly
    ``error`` and ``message``, the code one of the document's for that status; 429 with
    ``Retry-After``) and the state around it (the weights' digest included) are checked."""
    report = report if report is not None else Report()
    fz = {"Authorization": f"Bearer {tenant}"}
    http = requests.Session()
    http.headers.update(fz)
    info = http.get(url + P.INFO, timeout=30).json()
    d, vocab, limits = info["model_config"]["n_embd"], info["model_config"]["vocab_size"], info["limits"]
    u = info["shape"] == "u"
    gen = torch.Generator().manual_seed(0)
    last: dict = {}  # the memory figures of the last state read (settled)

    def tensors(meta: dict, rows: int = 2, t: int = 4, **extra) -> bytes:
        return encode({P.HIDDEN: torch.randn(rows, t, d, generator=gen), **extra}, meta)

    def send(label: str, method: str, path: str, **kw) -> requests.Response:
        if "data" in kw:
            kw.setdefault("headers", {})["Content-Type"] = P.CONTENT_TYPE
        resp = http.request(method, url + path, timeout=60, **kw)
        report.requests += 1
        report.statuses[resp.status_code] += 1
        report.by_operation[f"hostile {label}"] += 1
        return resp

    def ok(label: str, resp: requests.Response, status: int = 200) -> requests.Response:
        if resp.status_code != status:
            report.failures.append({"operation": f"hostile {label}", "mode": "hostile", "status": resp.status_code,
                                    "problems": [f"expected {status}"], "answer": resp.text[:300], "curl": ""})
        return resp

    def refused(label: str, status: int, method: str, path: str, weights: bool = True, **kw) -> None:
        before = state(url, weights, operator, tenant, last.get("memory"))
        resp = send(label, method, path, **kw)
        problems = []
        if resp.status_code != status:
            problems.append(f"expected {status}")
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not (isinstance(body, dict) and set(body) == {"error", "message"}):
            problems.append("the body is not the documented JSON {error, message}")
        elif body["error"] not in openapi.error_codes(status):
            problems.append(f"error code {body['error']!r} is not one of {openapi.error_codes(status)}")
        if status == 429 and "Retry-After" not in resp.headers:
            problems.append("no Retry-After")
        after = state(url, weights, operator, tenant, before["memory"])
        last["memory"] = after["memory"]
        if after != before:
            problems.append(f"state changed: { {k: (before[k], after[k]) for k in before if before[k] != after.get(k)} }")
        if problems:
            report.failures.append({"operation": f"hostile {label}", "mode": "hostile", "status": resp.status_code,
                                    "problems": problems, "answer": resp.text[:300], "curl": ""})

    step = http.get(url + P.CLIENT_STATE.format(client_id=client_id), timeout=30).json()["step"] + 1
    labels = torch.randint(0, vocab, (2, 4), generator=gen)
    # training as a client runs it: a step's piece(s), then its apply
    meta = P.StepMeta(client_id, step).to_meta()
    if u:
        ok("train forward", send("train forward", "post", P.TRAIN_FORWARD, data=tensors(meta)))
        ok("train backward", send("train backward", "post", P.TRAIN_BACKWARD,
                                  data=encode({P.GRAD: torch.randn(2, 4, d, generator=gen)}, meta)))
    else:
        ok("train step", send("train step", "post", P.TRAIN_STEP, data=tensors(meta, **{P.LABELS: labels})))
    ok("train apply", send("train apply", "post", P.TRAIN_APPLY,
                           json={"client_id": client_id, "step": step, "pieces": 1, "lr": 0.01}))
    step += 1
    two_way = {} if u else {P.LABELS: labels}
    route = P.TRAIN_FORWARD if u else P.TRAIN_STEP
    # 400: a closed step (micros >= 1: the server applied at its own lr) is gone
    refused("400 closed step", 400, "post", route,
            data=tensors({**P.StepMeta(client_id, step).to_meta(), "micros": "1"}, **two_way),
            headers={"Content-Type": P.CONTENT_TYPE})
    # 409: a step out of order (one ahead of the next), a backward with no forward, an apply of nothing
    refused("409 step out of order", 409, "post", route,
            data=tensors(P.StepMeta(client_id, step + 1).to_meta(), **two_way),
            headers={"Content-Type": P.CONTENT_TYPE})
    if u:
        refused("409 backward without its forward", 409, "post", P.TRAIN_BACKWARD,
                data=encode({P.GRAD: torch.randn(2, 4, d, generator=gen)}, P.StepMeta(client_id, step).to_meta()),
                headers={"Content-Type": P.CONTENT_TYPE})
        refused("409 apply of no pending step", 409, "post", P.TRAIN_APPLY,
                json={"client_id": client_id, "step": step, "pieces": 1, "lr": 0.01})
    # 413: a body over --max-body-mb; a forward whose working memory is over --max-request-memory-gb
    if limits["max_body_bytes"] <= 64 << 20:
        refused("413 body over --max-body-mb", 413, "post", route, data=b"\0" * (limits["max_body_bytes"] + 1),
                headers={"Content-Type": P.CONTENT_TYPE})
    big = (limits["max_batch"], limits["max_position_embeddings"])
    if big[0] * big[1] * d * 4 * 4 < limits["max_body_bytes"]:
        refused("413 forward over --max-request-memory-gb", 413, "post", P.FORWARD,
                data=encode({P.HIDDEN: torch.zeros(*big, d)}), headers={"Content-Type": P.CONTENT_TYPE})
    # sessions: open -> step -> (409: a stale position, a step number skipped) -> close
    sid = ok("open session", send("open session", "post", P.SESSIONS, json={"rows": 1}), 201).json()["session_id"]
    path = P.SESSION_STEP.format(session_id=sid)
    ok("session step", send("session step", "post", path,
                            data=tensors(P.SessionStepMeta(0, step=1).to_meta(), rows=1, t=3)))
    refused("409 session step at a stale position", 409, "post", path, weights=False,
            data=tensors(P.SessionStepMeta(0, step=2).to_meta(), rows=1, t=1), headers={"Content-Type": P.CONTENT_TYPE})
    refused("409 session step out of its numbering", 409, "post", path, weights=False,
            data=tensors(P.SessionStepMeta(3, step=5).to_meta(), rows=1, t=1), headers={"Content-Type": P.CONTENT_TYPE})
    ok("close session", send("close session", "delete", P.SESSION.format(session_id=sid)), 204)
    # 429: sessions past --max-sessions-per-tenant
    mine = []
    for _ in range(limits["max_sessions_per_tenant"] + 1):
        r = http.post(url + P.SESSIONS, json={"rows": 1}, timeout=30)
        if r.status_code != 201:
            break
        mine.append(r.json()["session_id"])
    refused("429 a session over --max-sessions-per-tenant", 429, "post", P.SESSIONS, weights=False, json={"rows": 1})
    for sid in mine:
        http.delete(url + P.SESSION.format(session_id=sid), timeout=30)
    return report


def serve(cuts, tmp: Path, extra=()) -> LocalServer:
    tokens = tmp / "tokens"
    tokens.write_text(f"operator {OPERATOR} operator\nfuzzer {FUZZER}\n")
    args = ["--model", "tiny", "--threads", "2", "--token-file", str(tokens), "--checkpoint-dir", str(tmp / "ckpt"),
            "--checkpoint-every", "1000000", *SMALL_LIMITS]
    for c in cuts:
        args += ["--cut", c]
    return LocalServer(args + list(extra), token=OPERATOR, env={"OMP_NUM_THREADS": "1"})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/fuzz.py", allow_abbrev=False,
                                description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=60, help="per operation and mode (positive, negative)")
    p.add_argument("--stateful-examples", type=int, default=200, help="scenarios of the state machine (0: none)")
    p.add_argument("--shapes", default="u,2-way")
    p.add_argument("--json", help="write the report here")
    a = p.parse_args(argv)
    out, failed, started = {}, 0, time.perf_counter()
    for shape in a.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp, serve(SHAPES[shape], Path(tmp)) as srv:
            t0 = time.perf_counter()
            rep = fuzz(srv.url, a.examples)
            if a.stateful_examples:
                stateful(srv.url, a.stateful_examples, report=rep)
            hostile(srv.url, report=rep)
            out[shape] = {**rep.to_dict(), "seconds": round(time.perf_counter() - t0, 1)}
            failed += len(rep.failures)
            print(f"{shape}: {rep.requests} requests in {out[shape]['seconds']} s, statuses "
                  f"{dict(sorted(rep.statuses.items()))}, {len(rep.failures)} failures")
            for f in rep.failures[:20]:
                print("  ", f["operation"], f["mode"], f["status"], f["problems"], "\n     ", f["curl"])
    total = sum(v["requests"] for v in out.values())
    print(f"total: {total} requests, {failed} failures, {time.perf_counter() - started:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"total_requests": total, "failures": failed, "shapes": out}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
