"""GET /v1/openapi.json: the OpenAPI 3.1 document built from the protocol module, checked against
the routes the Flask app registers, and schemathesis run from it against a real server
(benchmarks/fuzz.py: no 5xx, answers as documented, nothing changed by a 4xx): request by
request, then stateful (the document's links: open a session -> step -> close) and hostile
sequences that must answer 409, 413 and 429."""
import dataclasses
import os
import tempfile
from pathlib import Path

import pytest

from serverproc import OTHER, TENANTS, TOKEN, ServerProcess, assert_error, auth, post_tensors
from splitlearn.api import openapi
from splitlearn.api import protocol as P
from splitlearn.server.http.app import create_app
from splitlearn.server.config import ServerConfig

SERVERS = {"u": dict(cuts=(1, 3)), "2-way": dict(cuts=(2,)), "offload": dict(offload=True)}


def app_of(kind: str):
    if kind == "fed":  # the fed server (python -m splitlearn.server.http.fedapp)
        from splitlearn.model.loading import load_config
        from splitlearn.server.federation.clientside import ClientSide
        from splitlearn.server.federation.fedserver import FedConfig, FedRounds
        from splitlearn.server.http.fedapp import create_fedavg_app
        from splitlearn.server.federation.strategy import make_strategy
        from splitlearn.server.tenants import Tenants
        cfg = FedConfig("tiny", (1, 3), b"s" * 44, "splitfed")
        rounds = FedRounds(cfg, ClientSide(load_config("tiny"), (1, 3), model="tiny"), make_strategy("fedavg", None))
        return create_fedavg_app(rounds, Tenants(TENANTS))
    return create_app(ServerConfig(model="tiny", tokens=TENANTS, **SERVERS[kind]))


def served(app) -> dict:
    r = app.test_client().get(P.OPENAPI, headers=auth(OTHER))  # a tenant's token, not the operator's
    assert r.status_code == 200, r.get_data(as_text=True)
    return r.get_json()


@pytest.mark.parametrize("kind", [*sorted(SERVERS), "fed"])
def test_document_matches_the_app(kind):
    """Every route the app registers is in the document with its methods, and nothing else."""
    app = app_of(kind)
    registered = {(openapi.flask_rule(rule.rule), m.lower()) for rule in app.url_map.iter_rules()
                  for m in rule.methods - {"HEAD", "OPTIONS"}}
    doc = served(app)
    documented = {(openapi.flask_rule(path), m) for path, ops in doc["paths"].items() for m in ops}
    assert documented == registered
    assert (P.OPENAPI, "get") in documented and (P.HEALTH, "get") in documented
    assert ((P.TRAIN_STEP, "post") in documented) == (kind in ("u", "2-way"))
    assert ((P.FEDERATION_CLOSE, "post") in documented) == (kind == "fed")
    assert ((P.OFFLOAD_LINEAR, "post") in documented) == (kind == "offload")


def test_every_route_constant_is_described():
    """A route constant added to protocol.py without an entry in openapi.py fails here."""
    described = {op.route for op in openapi.operations({})}
    assert set(openapi.route_constants()) - described == set()
    assert {"HEALTH", "TRAIN_APPLY", "SESSION_STEP", "OPENAPI"} <= set(openapi.route_constants())


def test_document_is_openapi_3_1_with_the_protocol_fields():
    from schemathesis.specs.openapi.definitions import OPENAPI_31_VALIDATOR  # the 3.1 meta-schema it loads with

    doc = served(app_of("u"))
    OPENAPI_31_VALIDATOR.validate(doc)
    assert doc["openapi"] == "3.1.0"
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": doc["components"]["securitySchemes"]["bearer"]["description"]}
    paths = doc["paths"]
    assert paths[P.HEALTH]["get"]["security"] == [] and paths[P.INFO]["get"]["security"] == [{"bearer": []}]
    # JSON bodies from the message classes, with their limits
    apply = paths[P.TRAIN_APPLY]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(apply["properties"]) == set(P.ApplyRequest.FIELDS) and apply["additionalProperties"] is False
    assert apply["properties"]["lr"]["maximum"] == P.MAX_LR and apply["properties"]["pieces"]["maximum"] == P.MAX_PIECES
    rows = paths[P.SESSIONS]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]["rows"]
    assert rows["maximum"] == 64  # ServerConfig.max_batch, as /v1/info says
    # tensor bodies: binary safetensors, their tensor names and the dataclasses' metadata keys
    step = paths[P.TRAIN_FORWARD]["post"]
    assert step["requestBody"]["content"][P.CONTENT_TYPE]["schema"] == {
        "type": "string", "format": "binary", "description": step["requestBody"]["content"][P.CONTENT_TYPE]["schema"]["description"]}
    assert set(step["x-safetensors"]["metadata"]) == {f.name for f in dataclasses.fields(P.StepMeta)} | {"micros"}
    assert "closed steps" in step["x-safetensors"]["metadata"]["micros"]  # micros=0 only
    assert {P.HIDDEN, P.MASK} <= set(step["x-safetensors"]["tensors"])
    session = paths[P.SESSION_STEP]["post"]
    assert set(session["x-safetensors"]["metadata"]) == {f.name for f in dataclasses.fields(P.SessionStepMeta)}
    assert P.REORDER in session["x-safetensors"]["tensors"]
    assert P.SERVER_TIME_HEADER in step["responses"]["200"]["headers"]
    # errors: the one JSON shape of errors.py, each status with its codes
    e409 = doc["components"]["responses"]["E409"]["content"]["application/json"]["schema"]
    assert e409["required"] == ["error", "message"]
    assert e409["properties"]["error"]["enum"] == ["conflict", "not_your_turn", "stale_weights"]
    assert step["responses"]["409"] == {"$ref": "#/components/responses/E409"}
    assert paths[P.CHECKPOINT]["post"]["responses"]["403"] == {"$ref": "#/components/responses/E403"}


def test_links_chain_a_sessions_life():
    """POST /v1/sessions links to its step and its close by the id it answers (what
    schemathesis' state machine follows); every link names an operation of the document."""
    doc = served(app_of("u"))
    ids = {op["operationId"] for ops in doc["paths"].values() for op in ops.values()}
    links = doc["paths"][P.SESSIONS]["post"]["responses"]["201"]["links"]
    assert {name: (v["operationId"], v["parameters"]) for name, v in links.items()} == {
        "step": ("session_step", {"session_id": "$response.body#/session_id"}),
        "close": ("session", {"session_id": "$response.body#/session_id"})}
    assert doc["paths"][P.SESSION]["delete"]["operationId"] == "session"
    for ops in doc["paths"].values():
        for op in ops.values():
            for answer in op["responses"].values():
                assert all(v["operationId"] in ids for v in answer.get("links", {}).values())


@pytest.mark.parametrize("kind", ["u", "offload", "fed"])
def test_without_a_token_the_protocols_document_of_no_server_in_particular(kind):
    """Issue 41: a newcomer reads the spec without a token. The tokenless document is the one every
    server of this kind serves (made once, no server state: none of its cuts, widths or limits);
    a tenant gets its server's; a wrong token is still 401; a POST is no GET."""
    client = app_of(kind).test_client()
    r = client.get(P.OPENAPI)
    assert r.status_code == 200 and r.mimetype == "application/json"
    public = r.get_json()
    assert public["paths"].keys() == served(app_of(kind))["paths"].keys()
    assert public["paths"][P.OPENAPI]["get"]["security"] == []  # the document says so itself
    if kind != "fed":
        text = r.get_data(as_text=True)
        assert "cuts" not in public["info"]["description"] and "[1, 3]" not in text
        assert str(ServerConfig.__dataclass_fields__["max_body_bytes"].default) not in text  # no limits
    if kind == "u":
        assert "cuts [1, 3]" in served(app_of("u"))["info"]["description"]  # a tenant's: this server's
        other = create_app(ServerConfig(model="tiny", tokens=TENANTS, cuts=(2,), seed=5))
        assert other.test_client().get(P.OPENAPI).get_data() == r.get_data()  # another server, the same bytes
    assert_error(client.get(P.OPENAPI, headers={"Authorization": "Bearer wrong-token-0123456789"}), 401, "token")
    assert client.post(P.OPENAPI).status_code in (401, 405)
    assert_error(client.get(P.INFO), 401, "token")  # the server's own facts still need one


def test_no_static_route():
    """Flask's default /static/<path> was registered (and undocumented): gone."""
    assert_error(app_of("u").test_client().get("/static/x", headers=auth()), 404)


# -- schemathesis against a real server --------------------------------------------------

@pytest.mark.parametrize("shape", ["u", "2-way"])
def test_schemathesis_finds_nothing(shape, tmp_path):
    """A bounded run (the long one: benchmarks/fuzz.py, `make fuzz`): every operation, schema-valid
    and schema-invalid requests with a tenant's token; then a few scenarios of the state machine
    over the document's links and the hostile sequences (benchmarks/fuzz.py: stateful, hostile);
    no failure of schemathesis' checks, no state change after a 4xx, and the 409, 413 and 429
    answers reached with the documented JSON body."""
    from benchmarks.fuzz import SMALL_LIMITS, fuzz, hostile, stateful

    tokens = tmp_path / "tokens"
    tokens.write_text("\n".join(TENANTS) + "\n")
    # the checkpoints (the weights' digest around each refused POST: ~100 of them) in memory where
    # there is a tmpfs: the same files, without a disk's fsyncs (~55 ms -> ~12 ms each)
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path) as ckpt, \
            ServerProcess(SERVERS[shape]["cuts"], checkpoint_dir=Path(ckpt) / "ckpt",
                          extra=["--token-file", str(tokens), "--checkpoint-every", "1000000", *SMALL_LIMITS]) as srv:
        report = fuzz(srv.url, 2, operator=TOKEN, tenant=OTHER)  # per operation and mode: every route both ways
        stateful(srv.url, 8, operator=TOKEN, tenant=OTHER, report=report)
        hostile(srv.url, operator=TOKEN, tenant=OTHER, report=report)
    assert report.failures == [], report.failures[:5]
    assert len(report.by_operation) >= 19 and report.requests >= 120  # it did reach every route
    assert any(k.startswith("stateful POST /v1/sessions/") for k in report.by_operation)  # a chain was followed
    codes = set(report.statuses)
    assert {200, 201, 204, 400, 401, 403, 404, 409, 413, 429} <= codes, report.statuses
