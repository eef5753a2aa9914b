"""``python -m splitlearn.server`` as a real process: its command line and waitress's own answers."""
import subprocess
import sys

import pytest
import requests

from splitlearn.api import protocol as P
from splitlearn.server.http.cli import parse_args

from serverproc import TOKEN, ServerProcess, auth


def test_abbreviated_options_are_refused():
    with pytest.raises(SystemExit):
        parse_args(["--mode", "tiny", "--cut", "1"])  # not --model
    cfg = parse_args(["--model", "tiny", "--cut", "1", "--cut", "3"])
    assert cfg.model == "tiny" and cfg.cuts == (1, 3)


def test_batch_wait_is_parsed_and_checked():
    from splitlearn.errors import ConfigError
    assert parse_args(["--model", "tiny", "--cut", "1", "--batch-wait-ms", "0"]).batch_wait_ms == 0
    assert parse_args(["--model", "tiny", "--cut", "1"]).batch_wait_ms == 5.0
    with pytest.raises(ConfigError, match="batch-wait-ms"):
        parse_args(["--model", "tiny", "--cut", "1", "--batch-wait-ms", "-1"])


def test_bad_configuration_exits_2_with_one_line():
    r = subprocess.run([sys.executable, "-m", "splitlearn.server", "--model", "tiny"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error:" in r.stderr and "--cut" in r.stderr


def test_a_body_over_the_limit_gets_the_json_413_from_the_real_server():
    with ServerProcess((1, 3), extra=["--max-body-mb", "0.01"]) as srv:  # 10 KiB
        body = b"\x00" * (64 << 10)
        r = requests.post(srv.url + P.TRAIN_FORWARD, data=body, timeout=30,
                          headers={**auth(TOKEN), "Content-Type": P.CONTENT_TYPE})
        assert r.status_code == 413
        assert r.headers["Content-Type"].startswith("application/json")
        payload = r.json()
        assert payload["error"] == "payload_too_large" and set(payload) == {"error", "message"}
        # the server keeps serving
        assert requests.get(srv.url + P.HEALTH, timeout=10).json()["status"] == "ok"
        small = requests.post(srv.url + P.ECHO, data=b"x" * 100, timeout=10,
                              headers={**auth(TOKEN), "Content-Type": P.CONTENT_TYPE})
        assert small.status_code == 200 and small.content == b"x" * 100


def test_weak_tokens_stop_the_server_unless_forced(tmp_path, monkeypatch):
    from splitlearn.errors import ConfigError
    # the real command stops (exit 2) without naming the token; the same check in-process for
    # another kind of weak token (a fresh interpreter costs ~9 CPU-seconds)
    r = subprocess.run([sys.executable, "-m", "splitlearn.server", "--model", "tiny", "--cut", "1"],
                       capture_output=True, text=True, timeout=120,
                       env={"SPLITLEARN_TOKEN": "change-me", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "weak token" in r.stderr and "change-me" not in r.stderr, r.stderr
    monkeypatch.setenv("SPLITLEARN_TOKEN", "short-token")  # under 16 characters
    with pytest.raises(ConfigError, match="weak token") as e:
        parse_args(["--model", "tiny", "--cut", "1"])
    assert "short-token" not in str(e.value)
    monkeypatch.setenv("SPLITLEARN_TOKEN", "change-me")  # an example
    assert parse_args(["--model", "tiny", "--cut", "1", "--allow-weak-tokens"]).tenants.names == ["t-" + __import__(
        "hashlib").sha256(b"change-me").hexdigest()[:12]]
    f = tmp_path / "tokens"
    f.write_text(f"# tenants\nalice {TOKEN} operator\n\nmallory {TOKEN}-2\n")
    tenants = parse_args(["--model", "tiny", "--cut", "1", "--token-file", str(f)]).tenants
    assert tenants.names == ["alice", "mallory"]
    assert tenants.authenticate(f"Bearer {TOKEN}").operator
    assert not tenants.authenticate(f"Bearer {TOKEN}-2").operator
    assert tenants.authenticate(f"Bearer {TOKEN}-3") is None and tenants.authenticate(TOKEN) is None
    f.write_text(f"alice {TOKEN}\nalice {TOKEN}-2\n")
    with pytest.raises(ConfigError, match="twice"):
        parse_args(["--model", "tiny", "--cut", "1", "--token-file", str(f)])
    f.write_text(f"alice {TOKEN} admin\n")
    with pytest.raises(ConfigError, match="3 words") as e:
        parse_args(["--model", "tiny", "--cut", "1", "--token-file", str(f)])
    assert TOKEN not in str(e.value)


def test_the_command_line_is_the_config_fields():
    """Every option is a field of the config (its default written once, there), with help text;
    an option not given is the field's default, and units convert (MiB, GiB, 'none')."""
    import dataclasses

    from splitlearn.server.config import GROUPS, ServerConfig
    from splitlearn.server.http.cli import parser
    from splitlearn.server.options import flag_of, options

    actions = {a.option_strings[0]: a for a in parser()._actions if a.option_strings and a.option_strings[0] not in ("-h", "--help", "--help-all")}
    flags = [flag_of(f) for group in GROUPS for f in options(group)]
    assert sorted(actions) == sorted(flags) and len(flags) > 60
    assert all(actions[f].help for f in flags)
    assert {"--cut", "--token-file", "--max-body-mb", "--no-batching", "--fed-secret-file", "--session-ttl",
            "--lora-r", "--log-level", "--offload-plain"} <= set(flags)
    assert not any("offload-record" in f or "offload-tamper" in f for f in flags)  # test hooks are no options
    cfg = parse_args(["--model", "tiny", "--cut", "1"])
    for f in dataclasses.fields(ServerConfig):
        if f.name not in ("model", "cuts", "tokens", "generated_token"):
            assert getattr(cfg, f.name) == f.default, f.name
    cfg = parse_args(["--model", "tiny", "--cut", "1", "--max-body-mb", "0.5", "--max-memory-gb", "2",
                      "--max-update-norm", "none", "--no-batching", "--round-timeout", "7"])
    assert (cfg.max_body_bytes, cfg.max_memory_bytes, cfg.max_update_norm) == (1 << 19, 2 << 30, None)
    assert cfg.batching is False and cfg.round_timeout_s == 7.0


def test_help_shows_each_default_in_the_options_unit():
    """Issue 41: ``--help`` shows defaults, in the unit the option is given in (MiB, not bytes)."""
    from splitlearn.server.config import ServerConfig
    from splitlearn.server.http.cli import parser

    text = " ".join(parser().format_help().split())  # one line: argparse wraps where it likes
    assert text.startswith("usage: python -m splitlearn.server (--model MODEL | --segment SEGMENT)")
    assert "the server's optimizer (AdamW: decoupled weight decay; SGD: L2) (default: adamw)" in text
    assert "(default: 0.001)" in text and "(default: 0.0)" in text  # --lr, --weight-decay
    body_mb = ServerConfig.__dataclass_fields__["max_body_bytes"].default / (1 << 20)
    assert f"(default: {body_mb:g})" in text.split("--max-body-mb")[1].split("--")[0]
    assert "(default: None)" not in text and "(default: False)" not in text


def test_profile_dir_writes_the_compute_threads_profile_at_sigterm(tmp_path):
    """--profile-dir: torch.profiler on the compute thread from start to SIGTERM; the table
    names the trunk's operators (a forward ran there), and nothing is written before the end."""
    import torch

    from splitlearn.transport import Transport, TransportConfig
    from splitlearn.api.wire import pack

    with ServerProcess((1, 3), extra=["--profile-dir", str(tmp_path)]) as srv:
        t = Transport(TransportConfig(srv.url, TOKEN))
        h = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
        assert P.HIDDEN in t.call(P.FORWARD, pack(P.HIDDEN, h, "float32"), {"wire_dtype": "float32"})
        t.close()
        assert not (tmp_path / "server-profile.txt").exists()
    table = (tmp_path / "server-profile.txt").read_text()
    assert "Self CPU" in table and "aten::addmm" in table
