"""``python -m splitlearn.client``: train, generate (text and --json), info, bad input."""
import json
import os
import subprocess
import sys

import pytest
import torch

import splitlearn as sl
from splitlearn.model.checkpoint import has_state
from splitlearn.client.cli import main
from splitlearn.procs import localserver
from splitlearn.procs.localserver import LocalServer


@pytest.fixture(scope="module")
def server():
    with LocalServer(["--model", "tiny", "--cut", "1", "--cut", "3", "--device", "cpu"]) as srv:
        yield srv


@pytest.fixture
def env(server, monkeypatch):
    monkeypatch.setenv("SPLITLEARN_TOKEN", server.token)
    return server


def test_info_prints_the_servers_info(env, capsys):
    assert main(["info", "--server", env.url]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cuts"] == [1, 3] and info["segment"]["kind"] == "trunk"


def test_train_reports_a_summary_and_saves(tmp_path, capsys, monkeypatch):
    # its own server: training changes the weights the generation tests compare against
    with LocalServer(["--model", "tiny", "--cut", "1", "--cut", "3", "--device", "cpu"]) as srv:
        monkeypatch.setenv("SPLITLEARN_TOKEN", srv.token)
        _train_and_resume(srv, tmp_path, capsys)
        _generate_with_the_trained_client(srv, tmp_path / "ck", capsys)


def _generate_with_the_trained_client(srv, saved, capsys):
    """``generate --load DIR`` samples from the client ``train --save DIR`` trained (the
    library's own ``SplitClient.load`` of the same directory), not from the spec's random blocks."""
    from splitlearn.client import SplitClient

    prompt = [72, 101, 108, 108, 111]
    argv = ["generate", "--server", srv.url, "--model", "tiny", "--device", "cpu", "--greedy", "--json",
            "--prompt-ids", " ".join(map(str, prompt)), "--max-new-tokens", "12"]
    assert main([*argv, "--load", str(saved)]) == 0
    out = capsys.readouterr()
    loaded = json.loads(out.out)["ids"]
    assert "saved at step 3" in out.err
    with SplitClient(srv.url, "tiny", token=srv.token, device="cpu") as client:
        untrained = client.generate(torch.tensor([prompt]), max_new_tokens=12).tolist()
        client.load(saved)
        trained = client.generate(torch.tensor([prompt]), max_new_tokens=12).tolist()
    assert loaded == trained and trained != untrained
    assert main([*argv, "--load", str(saved.parent)]) == 2  # no client saved there
    assert "no trained client" in capsys.readouterr().err


def _train_and_resume(env, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 40)
    rc = main(["train", "--server", env.url, "--model", "tiny", "--device", "cpu", "--data", str(corpus),
               "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--save", str(tmp_path / "ck"),
               "--json", "--quiet"])
    assert rc == 0
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert summary["steps"] == 3 and summary["stats"]["calls"] == 6  # forward + backward per step
    assert summary["stats"]["bytes_sent"] > 3 * 2 * 16 * 32 * 4  # at least the activations
    assert "trained 3 steps" in out.err
    assert has_state(tmp_path / "ck", "client")
    # resuming at the saved step with --steps equal to it has nothing to do
    assert main(["train", "--server", env.url, "--model", "tiny", "--device", "cpu", "--data", str(corpus),
                 "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--resume", str(tmp_path / "ck"),
                 "--quiet"]) == 0
    assert "nothing to do" in capsys.readouterr().err


def test_generate_json_is_one_object_equal_to_hf_generate(env, tmp_path):
    """A real subprocess: stdout must hold exactly one JSON object and nothing else. (Forked from the
    tests' preloaded interpreter, as the servers are, where it can be: ``python -m``'s own set-up, its
    own stdout file, without ~9 CPU-seconds of importing torch again; SPLITLEARN_FORK_SERVERS=0: exec'd.)"""
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with open(stdout, "w") as so, open(stderr, "w") as se:
        proc = localserver.launch(
            [sys.executable, "-m", "splitlearn.client", "generate", "--server", env.url, "--model", "tiny",
             "--device", "cpu", "--prompt-ids", "72 101 108 108 111", "--max-new-tokens", "8", "--greedy",
             "--json"], env={**os.environ, "SPLITLEARN_TOKEN": env.token}, stdout=so, stderr=se)
        try:
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == 0, stderr.read_text()
    out = json.loads(stdout.read_text())  # the whole stdout parses as one object
    assert set(out) == {"ids", "text", "stats"}
    model = sl.load_model("tiny")
    ref = model.generate(torch.tensor([[72, 101, 108, 108, 111]]), max_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=256)
    assert out["ids"] == ref.tolist()
    assert out["text"][0].startswith("Hello")
    assert out["stats"]["calls"] == 8  # one prefill + 7 decode steps


def test_generate_streams_text(env, capsys):
    assert main(["generate", "--server", env.url, "--model", "tiny", "--device", "cpu", "--prompt", "Hi",
                 "--max-new-tokens", "5", "--temperature", "0.9", "--seed", "3"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Hi") and "5 tokens" in out.err


@pytest.mark.parametrize("argv, words", [
    (["generate", "--prompt", "x" * 70, "--max-new-tokens", "4"], "n_positions"),
    (["generate", "--prompt", "", "--max-new-tokens", "4"], "empty"),
])
def test_bad_generate_input_exits_2_with_a_message(env, capsys, argv, words):
    rc = main([argv[0], "--server", env.url, "--model", "tiny", "--device", "cpu", *argv[1:]])
    assert rc == 2
    assert words in capsys.readouterr().err


def test_wrong_token_is_a_clear_error(server, monkeypatch, capsys):
    monkeypatch.setenv("SPLITLEARN_TOKEN", "wrong")
    assert main(["info", "--server", server.url]) == 2
    assert "token" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["train", "--server", "http://127.0.0.1:9", "--mod", "tiny", "--steps", "1"],
                                  ["generate", "--server", "http://127.0.0.1:9", "--model", "tiny", "--prom", "x"]])
def test_abbreviated_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and ("is required" in err or "are required" in err)  # not abbreviated


def test_token_file_is_read_as_the_server_reads_it(tmp_path, server, capsys, monkeypatch):
    monkeypatch.delenv("SPLITLEARN_TOKEN", raising=False)
    f = tmp_path / "tokens"
    f.write_text(f"# the token of this client\n\n{server.token}\n")
    assert main(["info", "--server", server.url, "--token-file", str(f)]) == 0
    assert json.loads(capsys.readouterr().out)["cuts"] == [1, 3]


def test_train_and_generate_with_a_defense(capsys, monkeypatch):
    # its own server: training changes the weights other tests compare against
    with LocalServer(["--model", "tiny", "--cut", "1", "--cut", "3", "--device", "cpu"]) as srv:
        monkeypatch.setenv("SPLITLEARN_TOKEN", srv.token)
        assert main(["train", "--server", srv.url, "--model", "tiny", "--steps", "2", "--batch-size", "2",
                     "--seq-len", "8", "--quiet", "--noise-sigma", "0.5", "--noise-clip", "1.0"]) == 0
        assert main(["generate", "--server", srv.url, "--model", "tiny", "--prompt-ids", "1 2 3",
                     "--max-new-tokens", "2", "--json", "--noise-sigma", "0.1"]) == 0
        assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ids"][0]) == 5
        assert main(["train", "--server", srv.url, "--model", "tiny", "--steps", "1", "--quiet",
                     "--noise-sigma", "-1"]) == 2
        assert "sigma" in capsys.readouterr().err


def test_train_lora_with_the_servers_options_and_export_the_adapter(tmp_path, capsys, monkeypatch):
    """``train --lora`` takes r, alpha and targets from the server; ``--export-adapter`` writes
    a peft directory whose server-side tensors are the ones the server trained."""
    from safetensors.torch import load_file

    with LocalServer(["--model", "tiny", "--cut", "1", "--cut", "3", "--device", "cpu",
                      "--lora-r", "2", "--lora-alpha", "4", "--lora-targets", "c_attn"]) as srv:
        monkeypatch.setenv("SPLITLEARN_TOKEN", srv.token)
        common = ["--server", srv.url, "--model", "tiny", "--device", "cpu", "--steps", "2", "--batch-size", "2",
                  "--seq-len", "8", "--quiet", "--client-id", "owner-a"]
        assert main(["train", *common]) == 2  # a LoRA server needs a LoRA client
        assert "lora" in capsys.readouterr().err.lower()
        assert main(["train", *common, "--export-adapter", str(tmp_path / "x")]) == 2  # needs --lora
        assert main(["train", *common, "--lora", "--export-adapter", str(tmp_path / "adapter"), "--json",
                     "--export-merged", str(tmp_path / "whole")]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2
    # --export-merged: the whole model, both sides' adapters merged: what peft's own merge of the exported
    # adapter into the base gives (a process server: the weights crossed HTTP)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "whole")
    assert type(whole).__name__ == "GPT2LMHeadModel" and len(AutoTokenizer.from_pretrained(tmp_path / "whole")) == 257
    ref = PeftModel.from_pretrained(sl.load_model("tiny"), tmp_path / "adapter").merge_and_unload()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(whole(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(whole(ids).logits, sl.load_model("tiny")(ids).logits, atol=1e-4)  # trained
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 2 and cfg["lora_alpha"] == 4 and cfg["target_modules"] == ["c_attn"]
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert {k.split(".")[4] for k in tensors} == {str(b) for b in range(4)}  # every block's c_attn
    assert any(float(t.abs().sum()) > 0 for k, t in tensors.items() if "lora_B" in k)  # trained: B left 0


@pytest.mark.parametrize("pin", [["--shape", "2way"], ["--expected-cuts", "2", "10"], ["--min-client-blocks", "2"]])
def test_the_client_pins_the_split_it_accepts(env, pin, capsys):
    # a U-shape server cut at (1, 3): each pin excludes it; nothing but GET /v1/info is sent
    rc = main(["generate", "--server", env.url, "--model", "tiny", "--device", "cpu", "--prompt-ids", "1 2 3",
               "--max-new-tokens", "2", "--json", *pin])
    assert rc != 0
    assert "cut" in capsys.readouterr().err


def test_an_error_after_streamed_text_starts_its_own_line(env, capsys, monkeypatch):
    from splitlearn.client.core import SplitClient
    from splitlearn.errors import SplitLearnError

    def fails_midway(self, *a, **kw):
        yield torch.tensor([104])
        yield torch.tensor([105])
        raise SplitLearnError("the server went away")

    monkeypatch.setattr(SplitClient, "generate_stream", fails_midway)
    rc = main(["generate", "--server", env.url, "--model", "tiny", "--device", "cpu", "--prompt", "Hi",
               "--max-new-tokens", "5"])
    out = capsys.readouterr()
    assert rc == 2 and out.out == "Hihi\n" and out.err.startswith("error: the server went away")


def test_a_refused_request_prints_no_half_line(env, capsys):
    rc = main(["generate", "--server", env.url, "--model", "tiny", "--device", "cpu", "--prompt", "Hi",
               "--max-new-tokens", "500"])
    out = capsys.readouterr()
    assert rc == 2 and out.out == "" and "n_positions" in out.err


def test_help_imports_no_torch_and_shows_defaults():
    """``--help`` answers without importing torch, transformers or requests (6 s before, issue 41)."""
    code = ("import sys, contextlib, io\n"
            "from splitlearn.client.cli import build_parser\n"
            "buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
            "    build_parser().parse_args(['train', '--help'])\n"
            "print(sorted(m for m in ('torch', 'transformers', 'requests') if m in sys.modules))\n"
            "print(buf.getvalue())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    first, _, helptext = proc.stdout.partition("\n")
    assert first == "[]"
    assert "(default: float32)" in helptext and "(default: 0.001)" in helptext and "(default: adamw)" in helptext



def _help(command: str) -> str:
    from splitlearn.client.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return " ".join(sub.choices[command].format_help().split())  # one line: argparse wraps where it likes


#: ClientConfig's fields that are not options of their own, and what stands in for them
NOT_OPTIONS = {"journal_dir": "--save", "defense": "--noise-sigma", "lora": "--lora"}


@pytest.mark.parametrize("command", ["train", "generate"])
def test_every_client_option_is_on_the_command_line_with_its_default(command):
    """The options are generated from ClientConfig's fields: each is there, with its help and its
    default (generate: not the optimizer's nor micro_batches; its --seed is the sampler's)."""
    import dataclasses

    from splitlearn.client.config import ClientConfig, Optimizer
    from splitlearn.procs.clihelp import flag_of, with_default

    text = _help(command)
    assert "--server SERVER" in text
    for f in dataclasses.fields(ClientConfig):
        if f.name in NOT_OPTIONS:
            assert not f.metadata["cli"] and NOT_OPTIONS[f.name] in _help("train")
            continue
        if command == "generate" and (f.name in {g.name for g in dataclasses.fields(Optimizer)}
                                      or f.name == "micro_batches"):
            continue
        flag = "--model-seed" if command == "generate" and f.name == "seed" else flag_of(f)
        assert flag in text, (command, flag)
        if f.type != "bool":
            shown = with_default(f.metadata["help"], f.default).replace("%%", "%")
            assert "".join(shown.split()) in "".join(text.split()), (command, f.name)  # "(default: X)" too


def test_the_options_parse_into_a_client_config(tmp_path):
    from splitlearn.client.cli import build_parser
    from splitlearn.client.config import ClientConfig
    from splitlearn.procs.clihelp import options_of

    token = tmp_path / "token"
    token.write_text("# a comment\nsecret\n")
    args = build_parser().parse_args([
        "train", "--server", "http://x", "--model", "tiny", "--steps", "1", "--token-file", str(token),
        "--client-id", "alice", "--wire-dtype", "int8", "--timeout", "5", "--retries", "2", "--wait-timeout", "7",
        "--reconnect-timeout", "9", "--min-client-blocks", "2", "--expected-cuts", "2", "3", "--shape", "u",
        "--seed", "4", "--micro-batches", "2", "--optimizer", "sgd", "--lr", "0.5", "--weight-decay", "0.1",
        "--device", "cpu", "--no-packed-weights", "--poll-idle"])
    cfg = ClientConfig(**options_of(ClientConfig, args))
    assert cfg == ClientConfig(token="secret", client_id="alice", wire_dtype="int8", timeout_s=5.0, retries=2,
                               wait_timeout_s=7.0, reconnect_timeout_s=9.0, min_client_blocks=2,
                               expected_cuts=(2, 3), shape="u", seed=4, micro_batches=2, optimizer="sgd", lr=0.5,
                               weight_decay=0.1, device="cpu", packed_weights=False, poll_idle=True)
    defaults = build_parser().parse_args(["generate", "--server", "http://x", "--model", "tiny", "--prompt", "a",
                                          "--model-seed", "3", "--seed", "5"])
    assert ClientConfig(**options_of(ClientConfig, defaults)) == ClientConfig(seed=3)
    assert defaults.sample_seed == 5
