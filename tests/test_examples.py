"""The examples in client/ (issue 20, item 7) run against a real tiny server, with tiny step counts.

``client/finetune_trainer.py``: transformers.Trainer on a local text file read through datasets
(both shapes); ``client/classify.py``: sequence classification with a plain PyTorch loop (a U-shape
server: it holds only the trunk). Each runs in this process through its ``main(argv)``.
"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from serverproc import TOKEN, InprocServerProcess

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "client" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module", params=[(1, 3), (2,)], ids=["u", "2way"])
def server(request):
    with InprocServerProcess(request.param) as srv:
        srv.u_shape = len(request.param) == 2
        yield srv


def test_finetune_with_trainer_on_a_text_file(server, tmp_path):
    pytest.importorskip("datasets")
    text = tmp_path / "stories.txt"
    text.write_text("\n".join(["Once upon a time there was a little cat.", "",
                               "The cat liked to sit in the sun and sleep.",
                               "One day the cat met a dog, and they became friends."] * 4))
    (tmp_path / "tokens").write_text(f"alice {TOKEN}\n")
    out = tmp_path / "out"
    summary = example("finetune_trainer").main([
        "--server", server.url, "--token-file", str(tmp_path / "tokens"), "--model", "tiny",
        "--text-file", str(text), "--seq-len", "32", "--batch-size", "4", "--grad-accum", "2",
        "--max-steps", "3", "--lr", "1e-3", "--output-dir", str(out), "--max-new-tokens", "8"])
    assert summary["steps"] == 3 and summary["server_applies"] == 3  # every Trainer step stepped the server
    assert len(summary["losses"]) == 3 and all(x > 0 for x in summary["losses"])
    assert summary["sample"].startswith("Once upon a time")
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    # the whole trained model saved at the end: a plain transformers checkpoint, the server's blocks trained
    from transformers import AutoModelForCausalLM

    from splitlearn import load_model

    whole = AutoModelForCausalLM.from_pretrained(out / "model")
    assert summary["model"] == str(out / "model") and type(whole).__name__ == "GPT2LMHeadModel"
    trained, at_load = whole.state_dict(), load_model("tiny").state_dict()
    name = "transformer.h.2.attn.c_attn.weight"  # a server-side block (cuts (1, 3) and (2,))
    assert not torch.allclose(trained[name], at_load[name])


def test_finetune_defaults_to_the_shipped_corpus():
    args = example("finetune_trainer").parse_args([])
    assert Path(args.text_file).name == "tiny_stories.txt" and Path(args.text_file).is_file()


def test_classify_with_a_plain_loop(server, tmp_path):
    if not server.u_shape:
        pytest.skip("sequence classification needs a U-shape server (a 2-way one holds the LM head)")
    result = example("classify").main(["--server", server.url, "--token", TOKEN, "--model", "tiny",
                                       "--steps", "6", "--batch-size", "8", "--lr", "3e-3",
                                       "--train-size", "64", "--test-size", "24"])
    assert result["server_applies"] == 6 and len(result["losses"]) == 6
    assert result["losses"][-1] < result["losses"][0]


def test_train_example_with_splitclient(server, monkeypatch, capsys):
    monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
    monkeypatch.setattr("sys.argv", ["train_example.py", "--server", server.url, "--model", "tiny", "--steps", "2",
                                      "--max-new-tokens", "8"])
    example("train_example").main()
    out = capsys.readouterr().out
    assert "Once upon a time" in out and "calls" in out
