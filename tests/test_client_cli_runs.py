"""``train`` around its loop (issue 51, items 2, 6, 7): Ctrl-C prints one line and resumes, a
``--save`` folder holding a run is not overwritten, the client checks the model's and the server's
limits before it sends (and splits evaluation and generation rows itself), an unreachable hub id
fails at once, and held-out evaluation with early stopping, from text, JSON lines or a dataset.
Against the real server app in this process (InprocServerProcess)."""
import json
import math
import os
import shlex
import subprocess
import sys
import time

import pytest
import torch

import splitlearn as sl
from splitlearn.client import SplitClient
from splitlearn.client.cli import main
from splitlearn.errors import ConfigError
from splitlearn.model.checkpoint import read_extra
from splitlearn.model.inputs import read_tokens
from splitlearn.model.data import ByteTokenizer

from serverproc import TOKEN, InprocServerProcess
from test_client_interrupt import Fault, cli


@pytest.fixture
def srv(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
    with InprocServerProcess((1, 3), checkpoint_dir=tmp_path / "server",
                             extra=["--checkpoint-every", "2", "--max-batch", "8"]) as s:
        yield s


def test_ctrl_c_prints_one_line_that_resumes(srv, tmp_path, monkeypatch, capsys):
    save = str(tmp_path / "run")
    argv = cli(srv, "--save", save)
    with monkeypatch.context() as mp:
        fault = Fault(mp, kill=False)
        fault.at_request = (9, "after")  # inside step 3
        assert main(argv) == 130
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and "loss_type" not in x]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("interrupted at step 3 (2 of 5 done); rerun with: ")
    command = shlex.split(lines[0].split("rerun with: ", 1)[1])
    assert command[1:3] == ["-m", "splitlearn.client"] and "--save" not in command
    assert command[command.index("--resume") + 1] == save
    assert main(command[3:]) == 0  # the printed command finishes the run
    assert srv.weights() and read_extra(save, "client", "model")


def test_a_save_folder_holding_a_run_is_not_overwritten(srv, tmp_path, capsys):
    save = tmp_path / "run"
    assert main(cli(srv, "--save", str(save), steps=2)) == 0
    before = read_extra(save, "client", "model")
    capsys.readouterr()
    assert main(cli(srv, "--save", str(save), steps=4)) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "--overwrite" in err and "step 2" in err
    assert all(torch.equal(v, read_extra(save, "client", "model")[k]) for k, v in before.items())  # untouched
    assert main(cli(srv, "--save", str(save), "--overwrite", "--json", steps=1)) == 0  # a new run there
    assert json.loads(capsys.readouterr().out)["steps"] == 1


def test_positions_and_rows_past_the_limits_are_refused_before_sending(srv, capsys):
    steps_before = srv.app.extensions["splitlearn"].ledger.steps_applied
    assert main(cli(srv, "--seq-len", "65")) == 2
    err = capsys.readouterr().err
    assert "64 positions" in err and "IndexError" not in err
    assert main(cli(srv, "--batch-size", "9")) == 2
    assert "8 rows per request" in capsys.readouterr().err
    assert srv.app.extensions["splitlearn"].ledger.steps_applied == steps_before  # nothing was trained


def test_evaluation_and_generation_split_rows_past_the_servers_limit(srv, tiny_model):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (19, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, :4] = 0  # some rows left-padded
    with SplitClient(srv.url, "tiny", token=TOKEN, device="cpu") as client:
        assert client.max_rows == 8
        loss = client.evaluate(ids, mask)
        out = client.generate(ids[:, :6], max_new_tokens=5)
    labels = ids.masked_fill(mask == 0, -100)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = tiny_model(input_ids=ids, attention_mask=mask, labels=labels, position_ids=pos).loss
        want = tiny_model.generate(ids[:, :6], attention_mask=torch.ones_like(ids[:, :6]), max_new_tokens=5,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    assert math.isclose(loss, float(ref), rel_tol=1e-5)
    assert torch.equal(out, want)
    with SplitClient(srv.url, "tiny", token=TOKEN, device="cpu") as client:
        with pytest.raises(ConfigError, match="64 positions"):
            client.train_step(torch.zeros(2, 65, dtype=torch.long))


@pytest.mark.slow
def test_an_unreachable_hub_id_fails_at_once_naming_offline_mode(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9", SPLITLEARN_TOKEN=TOKEN,
               OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "splitlearn.client", "train", "--server", "http://127.0.0.1:9",
                        "--model", "gpt2", "--steps", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr  # before torch is imported (cli.cmd_train): ~1 s, not ~10
    assert r.stderr.count("HF_HUB_OFFLINE=1") == 1 and "Traceback" not in r.stderr, r.stderr


def test_the_hub_check_takes_seconds_not_retries(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from splitlearn.client.runs import check_hub_source

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE=1") as e:
        check_hub_source("gpt2")
    assert time.monotonic() - t0 < 10 and "not in the Hugging Face cache" in e.value.message
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE=1 is set"):
        check_hub_source("someone/model")
    check_hub_source("tiny")  # a spec, a path: the loader's
    check_hub_source(str(tmp_path))


def _docs(n=40):
    return [f"document {i}: the cat sat on mat number {i}." for i in range(n)]


def test_jsonl_and_a_dataset_read_as_the_same_tokens(tmp_path):
    from datasets import Dataset, DatasetDict

    tok = ByteTokenizer()
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(_docs())))
    DatasetDict({"train": Dataset.from_dict({"text": _docs()}),
                 "validation": Dataset.from_dict({"text": _docs(3)})}).save_to_disk(str(tmp_path / "ds"))
    want = [t for d in _docs() for t in [*d.encode(), 256]]
    assert read_tokens(tok, tmp_path / "d.jsonl") == want
    assert read_tokens(tok, tmp_path / "ds") == want
    assert read_tokens(tok, tmp_path / "ds", split=("validation",)) == [t for d in _docs(3) for t in [*d.encode(), 256]]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ConfigError, match="line 2"):
        read_tokens(tok, tmp_path / "bad.jsonl")


def test_held_out_loss_every_n_steps_equals_the_trained_models(srv, tmp_path, capsys, tiny_model):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_dict({"text": _docs()}),
                 "validation": Dataset.from_dict({"text": _docs(12)[::-1]})}).save_to_disk(str(tmp_path / "ds"))
    save = tmp_path / "run"
    assert main(cli(srv, "--data", str(tmp_path / "ds"), "--eval-data", str(tmp_path / "ds"), "--eval-every", "2",
                    "--eval-rows", "10", "--save", str(save), "--json")) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert [e["step"] for e in summary["evals"]] == [2, 4, 5]
    assert "step 2: eval loss" in out.err
    last = summary["evals"][-1]
    assert math.isclose(last["perplexity"], math.exp(last["loss"]))
    # the last evaluation is the trained model's loss on the held-out rows, computed here unsplit
    model = sl.load_model("tiny")
    missing, unexpected = model.load_state_dict({**read_extra(save, "client", "model"), **srv.weights()},
                                                strict=False)
    assert unexpected == ["transformer.remote.grad_proxy"] and not missing, (missing, unexpected)
    rows = torch.tensor(read_tokens(ByteTokenizer(), tmp_path / "ds", split=("validation",))[:10 * 12]).view(10, 12)
    with torch.no_grad():
        ref = model(input_ids=rows, labels=rows).loss
    assert math.isclose(last["loss"], float(ref), rel_tol=1e-5)
    # evaluating changed no training step: both sides equal a run without --eval-data
    with InprocServerProcess((1, 3), checkpoint_dir=tmp_path / "plain-server", extra=["--checkpoint-every", "2"]) as s:
        assert main(cli(s, "--data", str(tmp_path / "ds"), "--save", str(tmp_path / "plain"))) == 0
        plain = s.weights()
    server = srv.weights()
    assert all(torch.equal(plain[k], server[k]) for k in plain)
    trained, untouched = read_extra(save, "client", "model"), read_extra(tmp_path / "plain", "client", "model")
    assert all(torch.equal(trained[k], untouched[k]) for k in trained)


def test_early_stop_when_the_held_out_loss_stops_improving(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in _docs(8)))
    with InprocServerProcess((1, 3), lr=5.0, optimizer="sgd") as s:  # a rate that makes the loss blow up
        rc = main(["train", "--server", s.url, "--model", "tiny", "--steps", "30", "--batch-size", "2",
                   "--seq-len", "12", "--lr", "5.0", "--optimizer", "sgd", "--device", "cpu", "--quiet", "--json",
                   "--eval-data", str(tmp_path / "eval.jsonl"), "--eval-every", "1", "--early-stop-patience", "2"])
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert rc == 0 and summary["early_stopped"] and summary["steps"] < 30, summary.get("evals")
    assert "early stop at step" in out.err
    evals = summary["evals"]
    assert all(e["loss"] >= summary["best_eval"]["loss"] for e in evals[-2:])


@pytest.mark.slow
def test_the_trainer_example_evaluates_a_held_out_split(tmp_path, monkeypatch):
    from test_examples import example

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(_docs(60)))
    (tmp_path / "tokens").write_text(TOKEN + "\n")
    with InprocServerProcess((1, 3)) as s:
        summary = example("finetune_trainer").main([
            "--server", s.url, "--token-file", str(tmp_path / "tokens"), "--model", "tiny", "--text-file", str(text),
            "--seq-len", "32", "--batch-size", "4", "--grad-accum", "1", "--max-steps", "2", "--eval-steps", "1",
            "--eval-fraction", "0.2", "--output-dir", str(tmp_path / "out"), "--max-new-tokens", "2"])
    evals = summary["evals"]
    assert [e["step"] for e in evals] == [1, 2, 2] and summary["server_applies"] == 2
    assert evals[-1]["loss"] == evals[-2]["loss"]  # evaluating twice at step 2 changed nothing
    assert all(math.isclose(e["perplexity"], math.exp(e["loss"])) for e in evals)
    assert evals[0]["loss"] != evals[1]["loss"]  # the held-out loss follows the training


def test_the_resume_line_names_the_run_to_resume(tmp_path):
    from splitlearn.client.runs import interrupted_line

    held = tmp_path / "run"
    (held / "wal").mkdir(parents=True)
    (held / "wal" / "0000000001-00000001.safetensors").write_bytes(b"")
    argv = ["train", "--model", "tiny", f"--save={held}", "--overwrite", "--steps", "9"]
    line = interrupted_line(3, 9, str(held), argv)
    assert line.startswith("interrupted at step 4 (3 of 9 done); rerun with: ")
    assert shlex.split(line.split(": ", 1)[1])[3:] == ["train", "--model", "tiny", "--resume", str(held), "--steps", "9"]
    fresh = str(tmp_path / "fresh")  # interrupted before its first checkpoint: the same command
    assert shlex.split(interrupted_line(0, 9, fresh, ["train", "--save", fresh]).split(": ", 1)[1])[3:] == \
        ["train", "--save", fresh]
    assert "nothing was saved" in interrupted_line(0, 9, None, ["train"])
