"""The benchmark baselines compute what splitlearn computes: the unsplit model's tokens and losses.

Both baselines run the tiny model cut at (1, 3) with real server processes on loopback. The
``torch.distributed.rpc`` baseline runs in a child process of its own, because ``init_rpc``
works only once per process and this one may need it for something else.
"""
import json
import os
import sys
from pathlib import Path

import pytest
import requests
import torch
import torch.distributed.rpc as rpc

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.baselines.common import BaselineConfig, parse_config  # noqa: E402
from benchmarks.baselines.naive_json import NaiveJsonSplit  # noqa: E402
from splitlearn import load_model  # noqa: E402
from splitlearn.errors import ConfigError, TransportError  # noqa: E402
import forkserver  # noqa: E402

pytestmark = pytest.mark.slow

CUTS = (1, 3)
NEW = 8  # new tokens; the prompt is 12 long, so 20 <= n_positions = 64
LR = 1e-2  # large enough that three steps change the loss visibly
STEPS = 3


def hf_greedy(model, ids):
    """``model.generate`` greedy, with no eos so it never stops early."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0)


def unsplit_losses(ids) -> list[float]:
    """STEPS AdamW steps (no weight decay) of a fresh unsplit model on ``ids``; the losses."""
    model = load_model("tiny", seed=0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# -- naive JSON over Flask + requests ----------------------------------------------------

def naive() -> NaiveJsonSplit:
    return NaiveJsonSplit("tiny", CUTS, lr=LR, seed=0, torch_threads=1)


def test_naive_generate_equals_hf_generate(tiny_model, batch):
    with naive() as split:
        got = split.generate(batch, NEW)
        assert torch.equal(got, hf_greedy(tiny_model, batch))
        assert split.stats["calls"] == NEW  # one POST /infer per token, the whole sequence each time
        calls, sent = split.stats["calls"], split.stats["bytes_sent"]
        split.ping()
        assert split.stats["calls"] == calls + 1 and split.stats["bytes_sent"] == sent + 2  # b"{}"


def test_naive_train_steps_equal_unsplit_adamw(batch):
    with naive() as split:
        losses = [split.train_step(batch) for _ in range(STEPS)]
        assert split.stats["calls"] == 2 * STEPS  # /forward and /backward
        floats = 2 * STEPS * batch.numel() * 32  # (B, T, d) back from each of the 2 calls a step
        assert split.stats["bytes_received"] > 4 * floats  # JSON text: more than float32's 4 B each
    want = unsplit_losses(batch)
    assert losses == pytest.approx(want, abs=1e-4)
    assert want[0] > want[-1]  # the steps did something


def test_naive_server_answers_health_and_reports_a_crash_with_its_stderr():
    with naive() as split:
        assert requests.get(split.url + "/health", timeout=5).json() == {}
    bad = NaiveJsonSplit("tiny", CUTS, startup_timeout_s=30)
    bad.server.cmd += ["--no-such-option"]  # the server's argparse exits with code 2 and a usage line
    with pytest.raises(TransportError, match=r"exited with code 2(.|\n)*--no-such-option"):
        bad.start()


# -- the shared config -------------------------------------------------------------------

def test_config_refuses_a_two_way_split():
    with pytest.raises(ConfigError, match="two cuts"):
        BaselineConfig("tiny", (2,), 8000)


@pytest.mark.parametrize("kw, words", [(dict(cuts=(3, 1)), "increasing"), (dict(port=0), "port"),
                                       (dict(lr=0.0), "lr"), (dict(torch_threads=0), "torch_threads")])
def test_config_refuses_bad_values(kw, words):
    with pytest.raises(ConfigError, match=words):
        BaselineConfig(**{"model": "tiny", "cuts": CUTS, "port": 8000, **kw})


@pytest.mark.parametrize("cfg", [BaselineConfig("tiny", CUTS, 8000),
                                 BaselineConfig("random:gpt2", (2, 10), 65535, 3e-4, 7, 2)])
def test_config_argv_round_trips(cfg):
    assert parse_config("test", cfg.argv()) == cfg


def test_config_command_line_refuses_bad_values_and_abbreviations(capsys):
    for argv in (["--model", "tiny", "--cut", "1", "--port", "8000"],  # one cut
                 ["--model", "tiny", "--cut", "1", "--cut", "3", "--po", "8000"]):  # abbreviated --port
        with pytest.raises(SystemExit) as e:
            parse_config("test", argv)
        assert e.value.code == 2
    assert "two cuts" in capsys.readouterr().err


# -- torch.distributed.rpc ---------------------------------------------------------------

CHILD = """
import json, os, sys
from multiprocessing import forkserver as mp_forkserver
root = sys.argv.pop(1)
sys.path.insert(0, root)  # the repository: `benchmarks` is a top-level folder, not installed
os.chdir(root)  # where `python -m benchmarks...` (its RPC server) finds it with the environment left as it is
fs = mp_forkserver._forkserver  # set where this process was forked by a fork server: that one's
if fs._forkserver_address is not None and fs._forkserver_alive_fd is not None:
    fs.ensure_running = lambda: None  # it is running (the tests' process holds it): fork the server from it
    sys.path.insert(0, os.path.join(root, "tests"))
    import forkserver
    forkserver.install()
    del sys.path[0]
import torch
from benchmarks.baselines.torch_rpc import TorchRpcSplit
torch.set_num_threads(1)
ids = torch.tensor(json.loads(sys.argv[1]))
out = {}
with TorchRpcSplit("tiny", (1, 3), lr=float(sys.argv[2]), seed=0, torch_threads=1) as split:
    c0 = split.stats["calls"]
    out["tokens"] = split.generate(ids, int(sys.argv[3])).tolist()   # before training changes weights
    c1 = split.stats["calls"]
    out["losses"] = [split.train_step(ids) for _ in range(int(sys.argv[4]))]
    c2 = split.stats["calls"]
    split.ping()
    out["calls"] = [c0, c1, c2, split.stats["calls"]]
    out["bytes_sent"] = split.stats["bytes_sent"]
try:
    TorchRpcSplit("tiny", (1, 3)).start()
    out["second"] = "started"
except RuntimeError as e:
    out["second"] = str(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def rpc_run(tmp_path_factory):
    """Generation, then training, then a ping, in a child process; what it measured.

    The child (``python -m rpc_baseline_child``, written to a directory of its own) is forked from
    the tests' preloaded interpreter where it can be (tests/forkserver.py: not ~9 CPU-seconds of
    imports), and so is its RPC server, a process of its own as ever (``python -m
    benchmarks.baselines.torch_rpc``, started by the child through the tests' fork server)."""
    if not rpc.is_available():
        pytest.skip("this torch build has no torch.distributed.rpc")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))  # the `batch` fixture
    here = tmp_path_factory.mktemp("rpc")
    (here / "rpc_baseline_child.py").write_text(CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    code = forkserver.run_module(here, "rpc_baseline_child", [str(ROOT), json.dumps(ids.tolist()), str(LR), str(NEW),
                                                              str(STEPS)], env=env, timeout=180)
    assert code == 0, (here / "stderr").read_text()[-3000:]
    return ids, json.loads((here / "stdout").read_text().strip().splitlines()[-1])


def test_rpc_generate_equals_hf_generate(rpc_run, tiny_model):
    ids, out = rpc_run
    assert torch.equal(torch.tensor(out["tokens"]), hf_greedy(tiny_model, ids))


def test_rpc_train_steps_equal_unsplit_adamw(rpc_run):
    ids, out = rpc_run
    assert out["losses"] == pytest.approx(unsplit_losses(ids), abs=1e-4)


def test_rpc_stats_count_calls(rpc_run):
    ids, out = rpc_run
    c0, c1, c2, c3 = out["calls"]
    assert c1 - c0 == 1 + NEW  # the session, then one call per token (prefill included)
    assert c2 - c1 == 3 * STEPS  # forward, distributed backward, optimizer step
    assert c3 - c2 == 1
    d = 32  # n_embd of the tiny model, float32
    prefill, decode = ids.numel() * d * 4, ids.shape[0] * d * 4 * (NEW - 1)
    assert out["bytes_sent"] == prefill + decode + 2 * STEPS * ids.numel() * d * 4


def test_rpc_second_init_in_one_process_is_refused(rpc_run):
    _, out = rpc_run
    assert "own process" in out["second"], out["second"]
