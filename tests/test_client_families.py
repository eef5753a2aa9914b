"""``SplitClient`` and ``python -m splitlearn.client`` on the other families (docs/MODELS.md): a tiny
Llama (GQA) and Gemma 2 saved with ``save_pretrained``, U-shape and 2-way, against in-process
servers of the same folder.

* A ``train_step``'s loss and every weight after it, on both sides, equal the unsplit model's
  hand-computed steps (test_client.py's tolerance), whole and in micro-batches; ``evaluate`` is the
  unsplit loss and ``generate`` the unsplit model's greedy tokens; ``save`` + ``load`` on a
  restarted server gives the saved weights bit for bit and trains on as the unsplit model.
* The CLI: ``train --micro-batches 2 --save``, then ``--resume``, leaves both sides bit for bit as one
  uninterrupted run; ``--export-merged`` is the whole model, whose greedy tokens ``generate --load``
  gives and whose loss ``--eval-data`` printed; ``--lora --export-adapter`` writes both sides' adapters.
* Bad input: another family, other sizes or another vocabulary are refused at start naming the
  fields (the CLI: one ``error:`` line, exit 2); a model given as an object is split as a copy; a folder without tokenizer files whose vocabulary
  is not the byte tokenizer's is refused naming the fix; a defense the family's split class
  does not take is refused, never dropped.
"""
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn.client import SplitClient
from splitlearn.client.cli import main
from splitlearn.client.runs import eval_windows
from splitlearn.model.data import get_tokenizer
from splitlearn.model.inputs import read_tokens
from splitlearn.errors import ConfigError
from splitlearn.model.arch import arch_of
from splitlearn.model.checkpoint import read_extra
from splitlearn.model.segments import labels_from_batch
from splitlearn.privacy import GaussianNoise, NoPeek

from serverproc import TOKEN, InprocServerProcess
from test_client import ATOL, LR, assert_sides_match, train_whole

pytestmark = pytest.mark.slow

#: (family, cuts, optimizer): each family U-shape and 2-way, each optimizer twice
CASES = [("llama-gqa", (1, 3), "sgd"), ("llama-gqa", (2,), "adamw"),
         ("gemma2", (1, 3), "adamw"), ("gemma2", (2,), "sgd")]
CLI_LR = 0.02  # the CLI runs' (a greedy continuation after them still varies)
BYTES = 257  # the byte tokenizer's ids: the CLI's fallback for a folder without tokenizer files


def _batches():
    """Three left-padded (ids, mask) batches; the last of 3 rows (micro-batches of 2 and 1)."""
    return [fam.padded(2, 7, 3, seed=0), fam.padded(2, 7, 2, seed=1), fam.padded(3, 7, 4, seed=2)]


BATCHES = _batches()


def save(folder, name, seed=0, **overrides):
    """A seeded random model of family ``name`` (its tiny config, ``overrides`` on it) saved to ``folder``."""
    cls, kw = fam.CONFIGS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(cls(**dict(kw, **overrides))).save_pretrained(folder)
    return str(folder)


def reference(folder, cuts):
    """The unsplit model of ``folder``; 2-way, its head untied (the server's is its own copy)."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    if len(cuts) == 1 and model.config.tie_word_embeddings:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    return model


def server(d, cuts, optimizer="sgd", extra=(), checkpoints="server", lr=None):
    """An in-process server of ``d / "model"``, checkpointing to ``d / checkpoints``."""
    return InprocServerProcess(cuts, optimizer=optimizer, lr=lr or LR[optimizer], model=str(d / "model"),
                               checkpoint_dir=d / checkpoints, extra=list(extra))


def client_of(srv, folder, optimizer="sgd", **kw) -> SplitClient:
    return SplitClient(srv.url, str(folder), token=TOKEN, optimizer=optimizer, lr=LR[optimizer], device="cpu", **kw)


def client_weights(client) -> dict:
    return {k: v for k, v in client.model.state_dict().items() if ".remote." not in k}


def assert_both_sides_equal(ref, client, srv, initial):
    client.flush()  # the last step's apply rides on the next request
    sides = {"client": client_weights(client), "server": srv.weights()}
    assert_sides_match(ref.state_dict(), initial, sides, {n for n, _ in ref.named_parameters()})


@pytest.mark.parametrize("name,cuts,optimizer", CASES, ids=[f"{n}-{'u' if len(c) == 2 else '2way'}-{o}"
                                                            for n, c, o in CASES])
def test_training_evaluation_and_generation_equal_the_unsplit_model(name, cuts, optimizer, tmp_path):
    folder = save(tmp_path / "model", name)
    with server(tmp_path, cuts, optimizer) as srv, client_of(srv, folder, optimizer) as client:
        assert type(client.model).__name__ == f"Split{type(fam.model(name)).__name__}"
        assert client.u_shape == (len(cuts) == 2) and client.segments is None
        initial = reference(folder, cuts).state_dict()
        losses = [client.train_step(*BATCHES[0])]
        client.micro_batches = 2  # the next step in two pipelined pieces of 2 and 1 rows
        losses += [client.train_step(*b) for b in BATCHES[1:]]
        ref = reference(folder, cuts)
        want = train_whole(ref, list(ref.parameters()), optimizer, BATCHES)
        assert losses == pytest.approx(want, abs=ATOL)
        assert client.step == 3
        assert_both_sides_equal(ref, client, srv, initial)

        ids, mask = fam.padded(2, 7, 3, seed=9)
        ref.eval()
        with torch.no_grad():
            ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels_from_batch(ids, mask),
                           position_ids=arch_of(ref.config).positions(mask, 0, ids.shape[1])).loss.item()
        assert client.evaluate(ids, mask) == pytest.approx(ref_loss, abs=ATOL)
        got = client.generate(ids, mask, max_new_tokens=6)
        tokens = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              pad_token_id=fam.PAD, eos_token_id=None)
        assert torch.equal(got, tokens)
        assert len(set(tokens[:, ids.shape[1]:].flatten().tolist())) > 1
        assert_both_sides_equal(ref, client, srv, initial)  # evaluation and generation changed nothing


@pytest.mark.parametrize("name,cuts", [("llama-gqa", (1, 3)), ("gemma2", (2,))], ids=["llama-u", "gemma2-2way"])
def test_save_and_load_on_a_restarted_server_resume_bit_for_bit(name, cuts, tmp_path):
    folder = save(tmp_path / "model", name)
    with server(tmp_path, cuts) as srv:
        with client_of(srv, folder) as first:
            for b in BATCHES[:2]:
                first.train_step(*b)
            first.save(tmp_path / "client")
            saved, client_id = client_weights(first), first.client_id
        srv.restart()  # checkpointed, a new app from the checkpoint
        with client_of(srv, folder) as resumed:  # its seeded weights until load()
            assert resumed.load(tmp_path / "client") == 2 and resumed.client_id == client_id
            now = client_weights(resumed)
            assert now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in saved)
            resumed.train_step(*BATCHES[2])
            ref = reference(folder, cuts)
            train_whole(ref, list(ref.parameters()), "sgd", BATCHES)
            assert_both_sides_equal(ref, resumed, srv, reference(folder, cuts).state_dict())


def test_a_model_that_is_not_the_servers_is_refused_naming_the_fields(tmp_path):
    folder = save(tmp_path / "model", "llama-gqa")
    with server(tmp_path, (1, 3)) as srv:
        for other, field in ((save(tmp_path / "qwen", "qwen2"), "model_type"),
                             (save(tmp_path / "wide", "llama-gqa", hidden_size=48), "hidden_size"),
                             (save(tmp_path / "vocab", "llama-gqa", vocab_size=100), "vocab_size"),
                             (save(tmp_path / "seed", "llama-gqa", seed=1), "weights at load")):
            with pytest.raises(ConfigError, match=f"not the server's.*{field}"):
                client_of(srv, other)
        given = AutoModelForCausalLM.from_pretrained(folder)
        before = {k: v.clone() for k, v in given.state_dict().items()}
        with SplitClient(srv.url, given, token=TOKEN, optimizer="sgd", lr=LR["sgd"]) as client:
            client.train_step(*BATCHES[0])  # the refusals left the server serving
        # a model given is split as a copy: the caller's is still whole and untrained
        assert type(given).__name__ == "LlamaForCausalLM" and len(given.model.layers) == 4
        assert all(torch.equal(v, before[k]) for k, v in given.state_dict().items())


def _takes_defenses(model) -> bool:
    return isinstance(getattr(type(model), "defense", None), property)


def test_a_defense_the_familys_split_class_does_not_take_is_refused(tmp_path):
    folder = save(tmp_path / "model", "llama-gqa")
    with server(tmp_path, (1, 3)) as srv:
        with client_of(srv, folder) as client:
            if _takes_defenses(client.model):
                pytest.skip("this family's split class takes defenses: see the NoPeek test")
        with pytest.raises(ConfigError, match="takes no defense yet"):
            client_of(srv, folder, defense=GaussianNoise(sigma=1.0))


def test_a_nopeek_step_reports_the_task_loss(tmp_path):
    """``train_step`` returns the task's loss (the model's ``defense_loss`` taken out of the loss it
    backpropagates): the unsplit model's first loss."""
    folder = save(tmp_path / "model", "llama-gqa")
    with server(tmp_path, (1, 3)) as srv, client_of(srv, folder, defense=NoPeek(weight=0.5)) as client:
        if not _takes_defenses(client.model):
            pytest.skip("this family's split class takes no defense yet: see the refusal test")
        loss = client.train_step(*BATCHES[0])
        extra = client.model.defense_loss
        assert extra is not None and float(extra.detach()) > 100 * ATOL  # the model's loss: the task's + this
        ref = reference(folder, (1, 3))
        want = train_whole(ref, list(ref.parameters()), "sgd", BATCHES[:1])
        assert loss == pytest.approx(want[0], abs=ATOL)  # the task's alone


# -- the command line -------------------------------------------------------------------------

def _train(srv, folder, data, steps, *extra):
    return main(["train", "--server", srv.url, "--model", folder, "--device", "cpu", "--data", str(data),
                 "--steps", str(steps), "--batch-size", "3", "--seq-len", "8", "--optimizer", "sgd",
                 "--lr", str(CLI_LR), "--micro-batches", "2", "--json", "--quiet", *extra])


def test_cli_trains_resumes_exports_and_generates_a_llama(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
    folder = save(tmp_path / "model", "llama-gqa", vocab_size=BYTES, pad_token_id=256, eos_token_id=256)
    data = tmp_path / "c.txt"
    data.write_text("the cat sat on the mat. " * 40)
    with server(tmp_path, (1, 3), lr=CLI_LR) as whole, \
            server(tmp_path, (1, 3), checkpoints="server-2", lr=CLI_LR) as parts:
        held_out = tmp_path / "eval.txt"
        held_out.write_text("a dog ran in the park, and the dog sat. " * 4)
        assert _train(whole, folder, data, 3, "--save", str(tmp_path / "whole"), "--eval-data", str(held_out),
                      "--eval-rows", "4") == 0
        out = capsys.readouterr()
        summary = json.loads(out.out)
        assert summary["steps"] == 3
        assert summary["stats"]["calls"] == 3 * 2 * 2 + 1  # 2 pieces, forward + backward; the evaluation
        assert "trained 3 steps" in out.err and "step 3: eval loss" in out.err

        assert _train(parts, folder, data, 2, "--save", str(tmp_path / "parts")) == 0
        assert json.loads(capsys.readouterr().out)["steps"] == 2
        assert _train(parts, folder, data, 3, "--resume", str(tmp_path / "parts"),
                      "--export-merged", str(tmp_path / "merged")) == 0
        assert json.loads(capsys.readouterr().out)["steps"] == 1
        a, b = (read_extra(tmp_path / run, "client", "model") for run in ("whole", "parts"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        sa, sb = whole.weights(), parts.weights()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)

        prompt = [72, 101, 108, 108, 111]
        assert main(["generate", "--server", parts.url, "--model", folder, "--device", "cpu", "--greedy",
                     "--json", "--prompt-ids", " ".join(map(str, prompt)), "--max-new-tokens", "8",
                     "--load", str(tmp_path / "parts")]) == 0
        got = json.loads(capsys.readouterr().out)["ids"][0]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    want = merged.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                           max_new_tokens=8, do_sample=False, pad_token_id=256, eos_token_id=None)[0].tolist()
    assert got == want and len(set(want[5:])) > 1
    # the held-out loss the run printed is the trained model's (the merged one's: the same weights)
    rows = eval_windows(read_tokens(get_tokenizer(folder), held_out), 8, 4)
    with torch.no_grad():
        loss = merged(input_ids=rows, labels=rows).loss.item()
    assert summary["evals"][-1]["loss"] == pytest.approx(loss, abs=ATOL)


def test_cli_lora_exports_both_sides_adapters_for_a_gemma2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
    folder = save(tmp_path / "model", "gemma2", vocab_size=BYTES, pad_token_id=256, eos_token_id=256)
    data = tmp_path / "c.txt"
    data.write_text("the cat sat on the mat. " * 40)
    targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    with server(tmp_path, (2,), lr=CLI_LR, extra=["--lora-r", "4", "--lora-targets", targets]) as srv:
        assert _train(srv, folder, data, 2, "--lora", "--export-adapter", str(tmp_path / "adapter")) == 0
        assert json.loads(capsys.readouterr().out)["steps"] == 2
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    for layer in range(4):  # the client's layers 0-1 and the server's 2-3
        assert any(f"layers.{layer}.self_attn.q_proj.lora_B" in k for k in adapter), layer
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at 0: trained


def test_cli_refuses_another_model_and_a_folder_without_its_tokenizer(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
    save(tmp_path / "model", "llama-gqa", vocab_size=BYTES)
    argv = ["generate", "--device", "cpu", "--greedy", "--prompt-ids", "5 6 7", "--max-new-tokens", "2"]
    with server(tmp_path, (1, 3)) as srv:
        for other, field in ((save(tmp_path / "qwen", "qwen2", vocab_size=BYTES), "model_type"),
                             (save(tmp_path / "wide", "llama-gqa", vocab_size=BYTES, hidden_size=48), "hidden_size")):
            assert main([*argv, "--server", srv.url, "--model", other]) == 2
            err = capsys.readouterr().err.strip().splitlines()[-1]  # after the loaders' progress bars
            assert err.startswith("error: this model is not the server's") and field in err
        # a folder of 96 tokens without tokenizer files: not the byte tokenizer's 257, named
        assert main([*argv, "--server", srv.url, "--model", save(tmp_path / "small", "llama-gqa")]) == 2
        err = capsys.readouterr().err
        assert "no tokenizer files" in err and "tokenizer.save_pretrained" in err


@pytest.mark.parametrize("name", ["llama-gqa", "gemma2", "qwen2", "gpt_neox"])
def test_a_folder_without_tokenizer_files_gets_the_bytes_or_a_clear_error(name, tmp_path):
    """transformers builds Gemma's, Qwen2's and GPT-NeoX's tokenizers from a folder without their files
    with only the special tokens (any text: one ``<unk>``); those folders get the byte tokenizer
    where their vocabulary is the bytes', else the error naming the fix, as Llama's and GPT-2's."""
    tok = get_tokenizer(save(tmp_path / "bytes", name, vocab_size=BYTES))
    assert tok.encode("the cat") == list(b"the cat")
    with pytest.raises(ConfigError, match="no tokenizer files"):
        get_tokenizer(save(tmp_path / "small", name))
