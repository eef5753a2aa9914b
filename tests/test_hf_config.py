"""The client's options written once (splitlearn/hf/config.py, issue 43): ``Connection``,
``RemoteConfig``, ``ModelOptions`` and ``SplitOptions``, from which ``ClientConfig``, a split
model's ``from_pretrained`` keywords and the client's command line are made."""
import dataclasses
import inspect
import subprocess
import sys

import pytest

from splitlearn.errors import ConfigError
from splitlearn.hf.config import HEAD_OPTIONS, WIRE_DTYPES, Connection, ModelOptions, RemoteConfig, SplitOptions

NOWHERE = "http://127.0.0.1:9"  # nothing listens: reaching the network would raise TransportError instead

#: a value other than the default for every connection field (a new field must be added here)
CONNECTION = dict(token="t0k", client_id="alice", wire_dtype="bfloat16", timeout_s=5.0, retries=2,
                  wait_timeout_s=7.0, reconnect_timeout_s=9.0, fed_url="http://fed", fed_token="f3d",
                  journal_dir="/tmp/j", min_client_blocks=2, expected_cuts=(2, 3), shape="u")


def names(cls) -> set:
    return {f.name for f in dataclasses.fields(cls)}


def keywords(func) -> set:
    return {p.name for p in inspect.signature(func).parameters.values() if p.kind is p.KEYWORD_ONLY}


def test_the_wire_dtypes_are_the_wires():
    from splitlearn.api.wire import WIRE_DTYPE_NAMES

    assert tuple(WIRE_DTYPES) == tuple(WIRE_DTYPE_NAMES)


def test_every_option_has_its_help():
    for cls in (RemoteConfig, ModelOptions):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


def test_from_pretrained_takes_exactly_the_options():
    """The keywords of from_pretrained and split_model are the one source's names, with its defaults."""
    from splitlearn.hf import SplitGPT2ForSequenceClassification, SplitGPT2LMHeadModel, SplitGPT2Model, split_model

    assert names(SplitOptions) == names(RemoteConfig) | names(ModelOptions)
    for cls in (SplitGPT2LMHeadModel, SplitGPT2ForSequenceClassification):
        assert keywords(cls.from_pretrained) == names(SplitOptions)
    assert keywords(SplitGPT2Model.from_pretrained) == names(SplitOptions) - set(HEAD_OPTIONS)
    assert keywords(split_model) == (names(RemoteConfig) - {"server"}) | {"remote"}
    sig = inspect.signature(SplitGPT2LMHeadModel.from_pretrained).parameters
    for f in dataclasses.fields(SplitOptions):
        if f.default is not dataclasses.MISSING:
            assert sig[f.name].default == f.default, f.name


def test_take_leaves_the_heads_config():
    kwargs = dict(server=NOWHERE, num_labels=3, lr=1.0, micro_batches=2, **CONNECTION)
    options = SplitOptions.take(kwargs)
    assert kwargs == {"num_labels": 3, "lr": 1.0}  # not options: the head's config
    assert options.micro_batches == 2 and options.server == NOWHERE
    remote = options.remote_config
    assert {k: getattr(remote, k) for k in CONNECTION} == CONNECTION
    with pytest.raises(ConfigError, match="server=URL"):
        SplitOptions.take({"token": "x"})


def test_remote_config_carries_every_connection_field():
    """A ClientConfig's connection reaches the RemoteConfig that SplitClient builds, field by field
    (a field dropped on the way would be its default there)."""
    from splitlearn.client.config import ClientConfig

    assert set(CONNECTION) == names(Connection)
    assert names(Connection) <= names(ClientConfig) and names(RemoteConfig) - names(Connection) == {"server",
                                                                                                    "apply_wait_s"}
    remote = RemoteConfig.of(NOWHERE, ClientConfig(**CONNECTION))
    assert remote.server == NOWHERE
    assert {k: getattr(remote, k) for k in CONNECTION} == CONNECTION
    assert remote.pins.expected_cuts == (2, 3) and remote.pins.shape == "u"


def test_remote_config_is_built_by_name():
    with pytest.raises(TypeError):
        RemoteConfig(NOWHERE, "token")  # noqa: the old positional call
    assert RemoteConfig(server=NOWHERE).apply_wait_s == 0.1


@pytest.mark.parametrize("options,words", [
    ({"micro_batches": 0}, "micro_batches"), ({"client_id": "bad id!"}, "client_id"),
    ({"wire_dtype": "float64"}, "wire dtype"), ({"timeout_s": 0}, "timeout_s"), ({"retries": -1}, "retries"),
    ({"apply_wait_s": 0}, "apply_wait_s"), ({"min_client_blocks": -1}, "min_client_blocks"),
    ({"expected_cuts": (1, 2, 3)}, "expected_cuts"), ({"shape": "v"}, "shape"),
])
def test_from_pretrained_refuses_a_bad_option_before_any_call(options, words):
    from splitlearn.hf import SplitGPT2LMHeadModel

    with pytest.raises(ConfigError, match=words):
        SplitGPT2LMHeadModel.from_pretrained("tiny", server=NOWHERE, **options)


def test_split_model_refuses_an_unknown_option():
    import splitlearn as sl

    with pytest.raises(ConfigError, match="unknown split_model option"):
        sl.split_model(sl.load_model("tiny"), server=NOWHERE, learning_rate=1e-3)


def test_the_options_import_no_torch():
    code = ("import sys\nimport splitlearn.hf.config, splitlearn.client.config\n"
            "print(sorted(m for m in ('torch', 'transformers', 'requests') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
