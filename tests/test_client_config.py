"""ClientConfig (splitlearn/client/config.py): the client's options in one dataclass, checked
before any network call (no server here: every bad value must fail before one is needed)."""
import dataclasses
import inspect

import pytest

from splitlearn.client import ClientConfig, SplitClient
from splitlearn.errors import ConfigError

NOWHERE = "http://127.0.0.1:9"  # nothing listens: reaching the network would raise TransportError instead


def test_defaults_and_overrides():
    c = ClientConfig()
    assert (c.optimizer, c.lr, c.wire_dtype, c.micro_batches, c.packed_weights) == ("adamw", 1e-3, "float32", 1, True)
    d = ClientConfig.of(ClientConfig(lr=3e-4, wire_dtype="int8"), client_id="alice")
    assert (d.lr, d.wire_dtype, d.client_id) == (3e-4, "int8", "alice")
    assert ClientConfig.of(None, lr=0.5) == ClientConfig(lr=0.5)
    assert "retries" in {f.name for f in dataclasses.fields(ClientConfig)}


@pytest.mark.parametrize("options,words", [
    ({"micro_batches": 0}, "micro_batches"), ({"micro_batches": 2.5}, "micro_batches"),
    ({"client_id": "bad id!"}, "client_id"), ({"client_id": "x" * 65}, "client_id"),
    ({"wire_dtype": "float64"}, "wire"), ({"optimizer": "lamb"}, "unknown optimizer"),
    ({"lr": -1.0}, "lr"), ({"timeout_s": 0}, "timeout_s"), ({"retries": -1}, "retries"),
    ({"wait_timeout_s": -5}, "wait_timeout_s"), ({"learning_rate": 1e-3}, "unknown SplitClient option"),
])
def test_bad_options_fail_before_any_call(options, words):
    with pytest.raises(ConfigError, match=words):
        ClientConfig.of(**options)
    with pytest.raises(ConfigError, match=words):  # the constructor: before it contacts the server
        SplitClient(NOWHERE, "tiny", **options)


def test_config_must_be_a_client_config():
    with pytest.raises(ConfigError, match="ClientConfig"):
        SplitClient(NOWHERE, "tiny", config={"lr": 1e-3})


def test_every_option_is_documented():
    doc = inspect.getdoc(SplitClient)
    for f in dataclasses.fields(ClientConfig):
        assert f"{f.name}" in doc, f.name


def test_the_fields_are_the_one_sources():
    """ClientConfig is the connection and the model's options of splitlearn.hf.config (the same
    fields as from_pretrained's) and the client's own, each written once with its help."""
    from splitlearn.client.config import Compute, Optimizer
    from splitlearn.hf.config import Connection, ModelOptions

    groups = [{f.name for f in dataclasses.fields(g)} for g in (Connection, ModelOptions, Optimizer, Compute)]
    assert sum(map(len, groups)) == len(dataclasses.fields(ClientConfig))
    assert set().union(*groups) == {f.name for f in dataclasses.fields(ClientConfig)}
    for f in dataclasses.fields(ClientConfig):
        assert f.metadata.get("help"), f.name
