"""The attacker's knowledge (a secret client: the attacker knows the public weights only) and the
gradient channel of the U-shape (what the server reads from the gradient at the second cut), in
measure_leakage and on the meter's command line (docs/PRIVACY.md, 'A secret client' and 'The
gradient channel')."""
import json

import pytest
import torch

from splitlearn import load_model
from splitlearn.model.data import ByteTokenizer
from splitlearn.apps.defensetrain import finetune_defense, main
from splitlearn.errors import ConfigError
from splitlearn.privacy import AttackConfig, GaussianNoise, measure_leakage
from splitlearn.defense.defenses import Defense
from splitlearn.privacy.meter import cut_gradients, median_token_norm, split_corpus, windows

FAST = dict(attacks=("linear", "whitebox"), seq_len=16, max_private_tokens=128, config=AttackConfig(epochs=8))


@pytest.fixture(scope="module")
def secret_client(tmp_path_factory):
    """The tiny model fine-tuned 12 steps without a defense, split at (1, 3): its weights are the
    client's secret (the server trained its own blocks and knows those)."""
    path = finetune_defense("tiny", (1, 3), Defense(), 12, cache_dir=tmp_path_factory.mktemp("ft"),
                            batch_size=4, seq_len=16, lr=3e-3, progress=False)
    return load_model(path)


def test_white_box_needs_the_clients_weights(tiny_model, secret_client):
    known = measure_leakage(secret_client, (1, 3), **FAST)
    public = measure_leakage(secret_client, (1, 3), attacker_model=tiny_model, **FAST)
    assert known.attacker_knows == "finetuned" and public.attacker_knows == "public"
    assert known.attacks["whitebox"] == 1.0  # the fine-tuned weights known: exact inversion
    # the public weights only: the search runs the wrong bottom, the inverters learn the wrong map
    assert public.attacks["whitebox"] < 0.5 and public.token_recovery < known.token_recovery - 0.4
    # the utility columns are the client's, whatever the attacker believes
    assert public.perplexity == pytest.approx(known.perplexity)
    assert public.as_dict()["attacker_knows"] == "public"
    # the reference itself measured with the public weights is the known-weights case
    same = measure_leakage(tiny_model, (1, 3), attacker_model=tiny_model, **FAST)
    assert same.attacks["whitebox"] == 1.0


def test_cut_gradients_are_the_loss_gradient_at_the_second_cut(tiny_model):
    ids = windows(ByteTokenizer(), split_corpus()[1], 16)[:3]  # (3, 16)
    g = cut_gradients(tiny_model, (1, 3), ids, None)  # (3, 16, 32)
    assert g.shape == (3, 16, tiny_model.config.n_embd)
    assert torch.count_nonzero(g[:, -1]) == 0  # the last position has no label
    grabbed = {}

    def keep(module, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h.retain_grad()
        grabbed["h"] = h

    hook = tiny_model.transformer.h[2].register_forward_hook(keep)  # output of block 2 = cut 3
    try:
        with torch.enable_grad():
            out = tiny_model(ids, labels=ids)
            (out.loss * 3 * 15).backward()  # the summed loss
    finally:
        hook.remove()
        tiny_model.zero_grad(set_to_none=True)
    torch.testing.assert_close(g, grabbed["h"].grad, rtol=1e-4, atol=1e-6)
    # without a defense the residual design changes nothing
    plain = cut_gradients(tiny_model, (1, 3), ids, GaussianNoise(0.0, 1e6))
    resid = cut_gradients(tiny_model, (1, 3), ids, GaussianNoise(0.0, 1e6, residual=True))
    torch.testing.assert_close(plain, g)
    torch.testing.assert_close(resid, g)


def test_the_gradient_gives_the_labels_away_under_the_noise(tiny_model):
    clip = median_token_norm(tiny_model, (1, 3), tokenizer=ByteTokenizer(), seq_len=16)
    d = GaussianNoise(sigma=4.0, clip=clip, residual=True)  # the recommended design's noise
    r = measure_leakage(tiny_model, (1, 3), defense=d, gradient_attacks=("linear",), **FAST)
    assert r.token_recovery < 0.25  # the activations at cut 1 are protected ...
    assert r.token_recovery_gradient > 0.6  # ... the gradient at cut 3 is not: it carries the labels
    assert set(r.gradient_attacks) == {"linear"}
    assert r.training_token_recovery == r.token_recovery_gradient
    assert any("gradient channel" in n for n in r.notes)
    json.dumps(r.as_dict())
    plain = measure_leakage(tiny_model, (1, 3), **FAST)  # not asked: not measured
    assert plain.token_recovery_gradient is None and plain.training_token_recovery == plain.token_recovery


@pytest.mark.parametrize("kw,match", [
    (dict(cut=1, gradient_attacks=("linear",)), "second cut of a U-shape"),
    (dict(cut=(1, 3), gradient_attacks=("whitebox",)), "unknown gradient attack"),
    (dict(cut=(1, 3), attacker_model="tiny"), "attacker_model"),
])
def test_bad_input(tiny_model, kw, match):
    with pytest.raises(ConfigError, match=match):
        measure_leakage(tiny_model, **kw, **FAST)


def test_cli_rows_per_attacker_knowledge_and_gradient(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITLEARN_CACHE", str(tmp_path))
    out, md = tmp_path / "out.json", tmp_path / "out.md"
    argv = ["--model", "tiny", "--train-steps", "3", "--cut", "1,3", "--defense", "none",
            "--defense-train-steps", "6", "--defense-batch-size", "4", "--defense-seq-len", "16",
            "--defense-lr", "3e-3", "--attacker-knows", "both", "--gradient-attacks", "linear",
            "--attacks", "linear,whitebox", "--epochs", "4", "--seq-len", "16",
            "--max-private-tokens", "64", "--no-progress", "--json", str(out), "--markdown", str(md)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    # the reference row once (its weights are the public ones), the fine-tuned row per knowledge
    assert [(r["defense_trained"], r["attacker_knows"]) for r in rows] == [
        (False, "finetuned"), (True, "finetuned"), (True, "public")]
    assert all(r["token_recovery_gradient"] is not None for r in rows)
    assert rows[1]["attacks"]["whitebox"] == 1.0 and rows[2]["attacks"]["whitebox"] < 1.0
    assert rows[1]["perplexity"] == rows[2]["perplexity"]
    table = md.read_text()
    assert "attacker knows" in table and "gradient at cut 2" in table and "| public |" in table


@pytest.mark.parametrize("argv,match", [
    (["--gradient-attacks", "whitebox"], "unknown gradient attack"),
    (["--attacker-knows", "everything"], "invalid choice"),
])
def test_cli_bad_input(tmp_path, monkeypatch, capsys, argv, match):
    monkeypatch.setenv("SPLITLEARN_CACHE", str(tmp_path))
    base = ["--model", "tiny", "--cut", "1,3", "--attacks", "linear", "--epochs", "1", "--seq-len", "16",
            "--max-private-tokens", "32", "--no-progress"]
    if "invalid choice" in match:
        with pytest.raises(SystemExit):
            main(base + argv)
    else:
        assert main(base + argv) == 2
    assert match in capsys.readouterr().err
