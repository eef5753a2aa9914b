"""Files, sockets, the store and the metrics are the server's own (issue 50, items 4, 5, 9):
each test runs the attack a second local user would (docs/SECURITY.md, 'Files and sockets are
the server's own', 'The store', 'Tenants see their own').

"Another user" is ``nobody`` (uid 65534): a file or socket is given to it with chown, or a child
process runs as it, which needs root; those parts skip cleanly otherwise. In-process except the
stranger's child processes (tiny, no torch)."""
from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import save as st_save

from splitlearn import partition
from splitlearn.errors import ConfigError, SegmentFileError, ServiceUnavailable
from splitlearn.model.checkpoint import (load_state, make_optimizer, open_private, private_dir, save_state,
                                         unique_parameters, write_private)
from splitlearn.model.loading import load_model
from splitlearn.procs.localserver import free_port

from serverproc import OTHER, TENANTS, TOKEN, auth

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a second user is simulated with chown/setuid: needs root")


def _segments():
    torch.manual_seed(0)
    parts = partition(load_model("tiny"), (1, 3))
    segs = [parts.bottom, parts.top]
    return segs, make_optimizer(unique_parameters(segs), "adamw", 1e-2)


def _stranger_dir(mode: int = 0o777) -> Path:
    """A directory under /tmp as a stranger makes one there: ``mode``, nobody's where possible."""
    d = Path(tempfile.mkdtemp(prefix="stranger-"))
    os.chmod(d, mode)
    if os.geteuid() == 0:
        os.chown(d, NOBODY, NOBODY)
    return d


def _drop():
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _stranger_python() -> str:
    """A python the stranger may run (this venv's may live under /root, closed to it)."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        st = os.stat(path) if os.path.exists(path) else None
        if st is not None and st.st_mode & 0o005 == 0o005 and not os.path.realpath(path).startswith("/root"):
            return path
    pytest.skip("no python the stranger (uid 65534) may run")


def _as_nobody(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` run by a system python as uid/gid 65534 (root only), no site packages: milliseconds."""
    return subprocess.run([_stranger_python(), "-S", "-c", textwrap.dedent(code), *args], preexec_fn=_drop,
                          capture_output=True, text=True, timeout=30, cwd="/")


# -- the checkpoint directory ------------------------------------------------------------------

def test_a_0777_checkpoint_dir_made_first_by_a_stranger_is_refused_at_start_with_the_reason():
    """The issue's attack: a stranger makes the directory first (0777, /tmp) with a complete,
    self-consistent checkpoint of weights x 1e9 in it; the server refused to start, saying what it
    found and what to do (before: "resumed ... 5 steps applied", outputs 2.55e9)."""
    from splitlearn.server import ServerConfig, create_app

    d = _stranger_dir(0o777)
    try:
        trunk = partition(load_model("tiny"), (1, 3)).trunk
        with torch.no_grad():
            for p in trunk.parameters():
                p.mul_(1e9)
        forged = save_state(Path(tempfile.mkdtemp()), "server", [trunk],
                            make_optimizer(trunk.parameters(), "adamw", 1e-3), {"steps_applied": 5})
        subprocess.run(["cp", "-a", str(forged), str(forged.parent / "server.latest"), str(d)], check=True)
        subprocess.run(["rm", "-rf", str(forged.parent)], check=True)
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(d)], check=True)
        with pytest.raises(ConfigError) as e:
            create_app(ServerConfig(model="tiny", cuts=(1, 3), tokens=TENANTS, checkpoint_dir=str(d)))
        said = str(e.value)
        assert str(d) in said and "refusing" in said and "remove it" in said
        assert ("owned by uid 65534" in said) if os.geteuid() == 0 else ("mode 0777" in said)
        with pytest.raises(ConfigError, match="writable by group or others|owned by"):
            private_dir(d)  # every writer (journal, client states, the cluster's run dir) the same
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=False)


def test_an_own_dir_writable_by_others_is_refused_and_one_only_readable_is_made_0700(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o775)
    with pytest.raises(ConfigError, match=r"writable by group or others \(mode 0775\)"):
        private_dir(loose)
    readable = tmp_path / "readable"
    readable.mkdir()
    os.chmod(readable, 0o755)
    private_dir(readable)
    assert stat.S_IMODE(os.stat(readable).st_mode) == 0o700
    made = private_dir(tmp_path / "a" / "b")
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o700 for p in (made, made.parent))
    shared = tmp_path / "shared"  # a group-writable directory above it, not sticky: someone could swap it
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match=r"the directory .*shared above it is writable"):
        private_dir(shared / "ckpt")


def test_a_link_planted_in_the_checkpoint_dir_is_never_followed(tmp_path):
    """A link at the name of a file the server is about to write (the pointer's temp file, a
    generation's file) is replaced, its target untouched; a link put in place of a saved file
    is refused at load, not read."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"the user's own file")
    d = private_dir(tmp_path / "ckpt")
    segs, opt = _segments()
    (d / "server.latest.tmp").symlink_to(victim)
    (d / "server-00000001.tmp").mkdir(mode=0o700)  # a crashed save's temp dir is swept (rmtree: no link followed)
    gen = save_state(d, "server", segs, opt, {"step": 1})
    assert victim.read_bytes() == b"the user's own file"
    assert not (d / "server.latest").is_symlink() and (d / "server.latest").read_text() == gen.name
    with open_private(d / "planted") as f:  # a link there: removed, a new 0600 file instead
        f.write(b"x")
    (d / "planted2").symlink_to(victim)
    with open_private(d / "planted2") as f:
        f.write(b"new")
    assert victim.read_bytes() == b"the user's own file" and not (d / "planted2").is_symlink()
    assert stat.S_IMODE(os.stat(d / "planted2").st_mode) == 0o600
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes((gen / "weights.safetensors").read_bytes())  # even the same bytes: a link is refused
    (gen / "weights.safetensors").unlink()
    (gen / "weights.safetensors").symlink_to(forged)
    with pytest.raises(SegmentFileError, match="a link is never followed"):
        load_state(d, "server", *_segments())


def test_a_forged_checkpoint_file_is_refused_not_loaded(tmp_path):
    """A file whose bytes differ from the digest the server wrote last (state.json, atomically)
    is refused; so is one the server did not write (another owner), digests and all."""
    d = private_dir(tmp_path / "ckpt")
    segs, opt = _segments()
    gen = save_state(d, "server", segs, opt, {"step": 1})
    good = (gen / "weights.safetensors").read_bytes()
    from safetensors.torch import load as st_load
    forged = {k: v * 1e9 for k, v in st_load(good).items()}
    (gen / "weights.safetensors").write_bytes(st_save(forged))
    segs2, opt2 = _segments()
    before = [p.detach().clone() for p in unique_parameters(segs2)]
    with pytest.raises(SegmentFileError, match="sha256 does not match"):
        load_state(d, "server", segs2, opt2)
    assert all(torch.equal(a, p) for a, p in zip(before, unique_parameters(segs2)))  # nothing loaded
    if os.geteuid() != 0:
        return
    # the stranger rewrites the manifest too (digests that match its file), as nobody
    meta = json.loads((gen / "state.json").read_bytes())
    import hashlib
    meta["files"]["weights.safetensors"] = hashlib.sha256((gen / "weights.safetensors").read_bytes()).hexdigest()
    (gen / "state.json").write_text(json.dumps(meta))
    for name in ("state.json", "weights.safetensors"):
        os.chown(gen / name, NOBODY, NOBODY)
    with pytest.raises(SegmentFileError, match="owned by uid 65534.*this server did not write it"):
        load_state(d, "server", segs2, opt2)


# -- the token file, the access log ------------------------------------------------------------

def test_the_generated_token_is_never_written_through_a_link_or_into_a_strangers_file(tmp_path):
    from splitlearn.server import ServerConfig
    from splitlearn.server.http.cli import write_generated_token

    cfg = ServerConfig(model="tiny", cuts=(2,), checkpoint_dir=str(tmp_path / "ckpt"))
    assert cfg.generated_token
    path = write_generated_token(cfg)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and path.read_text().strip() == cfg.tokens[0]
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    victim = tmp_path / "victim"
    victim.write_text("mine")
    link = tmp_path / "tok"
    link.symlink_to(victim)  # a link where the token goes: refused, never written through
    with pytest.raises(ConfigError, match="symbolic link"):
        write_generated_token(ServerConfig(model="tiny", cuts=(2,), token_out=str(link)))
    assert victim.read_text() == "mine"
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)  # a directory others may write: they could swap the file after it is written
    with pytest.raises(ConfigError, match="writable by group or others"):
        write_generated_token(ServerConfig(model="tiny", cuts=(2,), token_out=str(loose / "tok")))
    if os.geteuid() == 0:  # a file a stranger made first, to read what is written into it
        theirs = tmp_path / "theirs"
        theirs.write_text("")
        os.chown(theirs, NOBODY, NOBODY)
        with pytest.raises(ConfigError, match="owned by uid 65534"):
            write_private(theirs, b"secret")
        assert theirs.read_text() == ""


def test_a_token_file_others_may_write_is_refused(tmp_path):
    """A --token-file a stranger may write would let them add an operator token of their own."""
    from splitlearn.server.http.cli import parse_args

    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {TOKEN} operator\n")
    os.chmod(tokens, 0o600)
    assert parse_args(["--model", "tiny", "--cut", "2", "--token-file", str(tokens)]).tenants.names == ["alice"]
    os.chmod(tokens, 0o666)
    with pytest.raises(ConfigError, match="another local user could add a token"):
        parse_args(["--model", "tiny", "--cut", "2", "--token-file", str(tokens)])
    from splitlearn.api.protocol import read_token_file
    with pytest.raises(ConfigError, match=r"writable by group or others \(mode 0666\)"):
        read_token_file(str(tokens))
    if os.geteuid() == 0:
        os.chmod(tokens, 0o600)
        os.chown(tokens, NOBODY, NOBODY)
        with pytest.raises(ConfigError, match="owned by uid 65534"):
            read_token_file(str(tokens))


def test_the_access_log_is_0600_and_never_a_strangers_or_a_link(tmp_path):
    from splitlearn.server.http import accesslog

    try:
        path = tmp_path / "access.log"
        accesslog.configure("INFO", "text", str(path))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        old = tmp_path / "old.log"
        old.write_text("a line\n")
        os.chmod(old, 0o644)
        accesslog.configure("INFO", "text", str(old))  # our own, too open: made 0600, appended to
        assert stat.S_IMODE(os.stat(old).st_mode) == 0o600 and old.read_text() == "a line\n"
        link = tmp_path / "link.log"
        link.symlink_to(tmp_path / "elsewhere.log")
        with pytest.raises(ConfigError, match="--access-log"):
            accesslog.configure("INFO", "text", str(link))
        assert not (tmp_path / "elsewhere.log").exists()
        if os.geteuid() == 0:
            theirs = tmp_path / "theirs.log"
            theirs.write_text("")
            os.chown(theirs, NOBODY, NOBODY)
            with pytest.raises(ConfigError, match="owned by uid 65534"):
                accesslog.configure("INFO", "text", str(theirs))
    finally:
        accesslog.configure("WARNING", "text", None)


# -- unix sockets --------------------------------------------------------------------------------

@as_root
def test_the_server_refuses_a_socket_path_a_stranger_made():
    from splitlearn.server.http.unixdoor import UnixDoor
    from splitlearn.server.tenants import Tenants

    d = Path(tempfile.mkdtemp(prefix="sock-"))
    try:
        path = str(d / "s.sock")
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.close()  # a stale socket file, nobody listening: the door used to remove it and bind
        os.chown(path, NOBODY, NOBODY)
        with pytest.raises(ConfigError, match="owned by uid 65534.*refusing it"):
            UnixDoor(None, Tenants(TENANTS), path, max_body_bytes=1 << 20)
        assert os.stat(path).st_uid == NOBODY  # left as it was
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=False)


@as_root
def test_the_client_refuses_a_socket_a_stranger_serves_before_sending_a_byte(monkeypatch):
    """A stranger listens at the path the client was given (made first, or after the server
    died): the client refuses before its token leaves (SO_PEERCRED); told, it connects."""
    from splitlearn.transport.http import Transport, TransportConfig
    from splitlearn.transport.unix import PEER_UIDS_ENV, Connection, check_peer

    d = _stranger_dir(0o700)
    path = str(d / "s.sock")
    proc = subprocess.Popen([_stranger_python(), "-S", "-c", textwrap.dedent("""
        import socket, sys
        s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8); print("ready", flush=True)
        got = 0
        s.settimeout(20)
        try:
            while True:
                c, _ = s.accept(); c.settimeout(1)
                try:
                    while True:
                        b = c.recv(65536)
                        if not b: break
                        got += len(b)
                except OSError:
                    pass
                c.close(); print("got", got, flush=True)
        except OSError:
            pass
        """), path], preexec_fn=_drop, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert proc.stdout.readline().strip() == "ready"
        monkeypatch.delenv(PEER_UIDS_ENV, raising=False)
        with pytest.raises(ConfigError, match=f"served by uid {NOBODY}.*{PEER_UIDS_ENV}={NOBODY}"):
            Connection(path, region_bytes=0)
        t = Transport(TransportConfig("unix://" + path, TOKEN, retries=0))
        with pytest.raises(ConfigError, match="refusing to send it a token"):
            t.get_json("/v1/info")
        assert proc.stdout.readline().split() == ["got", "0"]  # the stranger read nothing
        monkeypatch.setenv(PEER_UIDS_ENV, str(NOBODY))  # the explicit option: that user's server is meant
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        check_peer(s, path)  # no refusal
        s.close()
    finally:
        proc.kill()
        proc.wait()
        subprocess.run(["rm", "-rf", str(d)], check=False)


# -- the SplitFed store --------------------------------------------------------------------------

def _group(store: str, world: int = 1):
    from splitlearn.server.config import GroupSpec
    from splitlearn.server.federation.collective import ReplicaGroup

    return ReplicaGroup(GroupSpec(store, 0, world, timeout_s=5.0), fed=None, run=None)


def test_a_stranger_cannot_fill_the_round_through_the_clusters_store(tmp_path):
    """The issue's attack: ``nobody`` adds 1000 to ``splitlearn/fed/r1/members``, and every
    replica answered 503 "round 1 is full". The cluster's store is a file in its private run
    directory: the stranger cannot open it (root: run as nobody), the round admits its K."""
    run = private_dir(tmp_path / "run")
    group = _group(f"file://{run / 'fed-store'}")
    group.admit(1, 2)  # the store made (the supervisor opens it before the replicas start)
    if os.geteuid() == 0:
        attack = _as_nobody("""
            import sys
            try:
                open(sys.argv[1], "r+b")  # what torch's FileStore does first, for add() or set()
            except OSError as e:
                print(type(e).__name__)
            else:
                print("opened")
            """, str(run / "fed-store"))
        assert attack.stdout.strip() == "PermissionError", attack
    assert group.counts(1) == (1, 0)
    group.admit(1, 2)  # the round's second member, as without a stranger
    with pytest.raises(ServiceUnavailable, match="round 1 is full"):
        group.admit(1, 2)
    assert group.counts(1) == (2, 0)


def test_a_store_file_or_directory_a_stranger_could_write_is_refused(tmp_path):
    from splitlearn.server.federation.collective import open_file_store

    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(ConfigError, match="--fed-store file://.*writable by group or others"):
        open_file_store(str(loose / "fed-store"))
    run = private_dir(tmp_path / "run")
    (run / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="symbolic link"):
        open_file_store(str(run / "link"))
    if os.geteuid() == 0:
        (run / "theirs").write_bytes(b"")
        os.chown(run / "theirs", NOBODY, NOBODY)
        with pytest.raises(ConfigError, match="owned by uid 65534"):
            open_file_store(str(run / "theirs"))


# -- the metrics port ----------------------------------------------------------------------------

def test_the_metrics_port_answers_the_operators_token_only():
    """Every local user reaches 127.0.0.1: a tokenless scrape used to list tenant names and
    their routes. 401 without a token, 403 for a tenant's, the families for the operator's."""
    from splitlearn.server import ServerConfig, create_app

    cfg = ServerConfig(model="tiny", cuts=(2,), tokens=TENANTS)
    app = create_app(cfg)
    assert app.test_client().get("/v1/info", headers=auth(OTHER)).status_code == 200  # mallory's request, counted
    port = free_port()
    server = app.extensions["splitlearn.metrics"].serve_loopback(port, cfg.tenants)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        r = requests.get(url, timeout=10)
        assert r.status_code == 401 and r.json()["error"] == "unauthorized" and "mallory" not in r.text
        assert requests.get(url, headers=auth("not-a-token-of-anyone-here"), timeout=10).status_code == 401
        r = requests.get(url, headers=auth(OTHER), timeout=10)  # a tenant's token: not the operator's
        assert r.status_code == 403 and "mallory" not in r.text
        r = requests.get(url, headers=auth(TOKEN), timeout=10)
        assert r.status_code == 200 and 'tenant="mallory"' in r.text
    finally:
        server.shutdown()
        server.server_close()
