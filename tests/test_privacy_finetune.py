"""Defense-aware fine-tuning (splitlearn.apps.defensetrain) through the model classes and an in-process
server; the meter's rows of fine-tuned models (the contract fields), the cache, the residual
design, the recommended preset, bad input."""
import json
import math

import pytest
import torch

from splitlearn import load_model
from splitlearn.model.data import ByteTokenizer
from splitlearn.apps.defensetrain import finetune_defense, finetune_info, main
from splitlearn.errors import ConfigError
from splitlearn.privacy import GaussianNoise, NoPeek, recommended
from splitlearn.privacy.cli import main as meter_main
from splitlearn.defense.defenses import GaussianNoPeek, parse_defense
from splitlearn.privacy.meter import median_token_norm, perplexities, split_corpus, windows
from splitlearn.privacy.presets import Preset

FT = dict(batch_size=4, seq_len=16, lr=3e-3, progress=False)


def public_windows(n=8):
    return windows(ByteTokenizer(), split_corpus()[0], 16)[:n]  # (n, 16), the fine-tuning text


def test_finetuning_with_the_defense_lowers_its_loss(tmp_path, tiny_model):
    cut = (1, 3)
    d = GaussianNoise(sigma=1.0, clip=median_token_norm(tiny_model, cut, tokenizer=ByteTokenizer(), seq_len=16))
    path = finetune_defense("tiny", cut, d, 12, cache_dir=tmp_path, **FT)
    info = finetune_info(path)
    assert info["steps"] == 12 and info["cut"] == [1, 3] and info["defense"] == d.describe()
    assert info["seconds"] > 0 and info["windows_sent"] == 48
    assert info["loss_last"] < info["loss_first"]
    tuned = load_model(path)
    ids = public_windows()
    before = perplexities(tiny_model, cut, ids, d, seed=1)[0]
    after = perplexities(tuned, cut, ids, d, seed=1)[0]
    assert after < 0.8 * before  # under the same noise draws
    # both sides trained: a client block and a server block moved
    for name in ("transformer.h.0.mlp.c_fc.weight", "transformer.h.1.mlp.c_fc.weight"):
        assert not torch.equal(tuned.state_dict()[name], tiny_model.state_dict()[name]), name


def test_the_cache_is_reused(tmp_path, monkeypatch):
    d = NoPeek(weight=0.5)
    path = finetune_defense("tiny", 2, d, 2, cache_dir=tmp_path, **FT)
    stamp = (path / "finetune.json").stat().st_mtime_ns
    import splitlearn.apps.defensetrain as dt

    def train_again(*a, **k):
        raise RuntimeError("trained again")

    monkeypatch.setattr(dt, "_train", train_again)
    assert finetune_defense("tiny", 2, NoPeek(weight=0.5), 2, cache_dir=tmp_path, **FT) == path
    assert (path / "finetune.json").stat().st_mtime_ns == stamp
    with pytest.raises(RuntimeError, match="trained again"):  # another defense: another run
        finetune_defense("tiny", 2, NoPeek(weight=0.25), 2, cache_dir=tmp_path, **FT)


def test_two_way_keeps_the_servers_own_head(tmp_path, tiny_model):
    path = finetune_defense("tiny", 2, GaussianNoise(sigma=0.5, clip=1.0), 3, cache_dir=tmp_path, **FT)
    tuned = load_model(path)
    assert not tuned.config.tie_word_embeddings
    assert tuned.lm_head.weight.data_ptr() != tuned.transformer.wte.weight.data_ptr()
    assert not torch.equal(tuned.lm_head.weight, tuned.transformer.wte.weight)  # each side trained its copy


@pytest.mark.parametrize("kw,match", [
    (dict(steps=0), "steps must be a positive integer"),
    (dict(steps=-3), "steps must be a positive integer"),
    (dict(defense="gaussian"), "defense must be"),
    (dict(cut=7), "out of range"),
    (dict(lr=0.0), "lr must be > 0"),
    (dict(seq_len=65), "max_position_embeddings=64"),
])
def test_bad_input(tmp_path, kw, match):
    args = dict(source="tiny", cut=1, defense=GaussianNoise(1.0, 1.0), steps=2, cache_dir=tmp_path)
    args.update(kw)
    with pytest.raises(ConfigError, match=match):
        finetune_defense(**args)
    assert not any(tmp_path.iterdir())  # nothing cached


@pytest.mark.parametrize("argv,match", [
    (["--defense-train-steps", "-1", "--defense", "gaussian:sigma=1"], "must be >= 0"),
    (["--defense", "bogus"], "unknown defense 'bogus'"),
    (["--defense", "gaussian:sigma=x"], "sigma must be a number"),
    (["--defense", "nopeek:sigma=1"], "no field 'sigma'"),
    (["--defense", "gaussian:sigma=1,residual=1"], "needs a U-shape"),
])
def test_cli_bad_input(tmp_path, monkeypatch, capsys, argv, match):
    monkeypatch.setenv("SPLITLEARN_CACHE", str(tmp_path))
    assert main(["--model", "tiny", "--cut", "1", "--attacks", "linear", "--epochs", "1",
                 "--seq-len", "16", "--max-private-tokens", "32", "--no-progress"] + argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") >= 1


def test_fine_tuning_needs_the_command_with_the_model_classes(capsys):
    """privacy.cli alone (layer 2) cannot train through the model classes: it says where to go."""
    assert meter_main(["--model", "tiny", "--cut", "1", "--defense", "nopeek", "--defense-train-steps", "1",
                       "--attacks", "linear", "--epochs", "1", "--seq-len", "16"]) == 2
    assert "python -m splitlearn.privacy" in capsys.readouterr().err


CONTRACT = ("cut", "defense", "defense_trained", "token_recovery", "best_attack", "perplexity",
            "perplexity_undefended", "epsilon", "finetune_seconds", "finetune_steps")


def test_rows_of_fine_tuned_defenses(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITLEARN_CACHE", str(tmp_path))
    out = tmp_path / "out.json"
    argv = ["--model", "tiny", "--train-steps", "3", "--cut", "1,3", "--defense", "gaussian:sigma=1",
            "--defense", "recommended", "--defense-train-steps", "4", "--defense-batch-size", "2",
            "--defense-seq-len", "16", "--attacks", "linear", "--epochs", "2", "--seq-len", "16",
            "--max-private-tokens", "64", "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["defense"]["name"] for r in rows] == ["none", "gaussian", "gaussian"]
    for r in rows:
        assert set(CONTRACT) <= set(r), set(CONTRACT) - set(r)
        assert r["cut"] == [1, 3] and not r["labels_reach_server"]
        assert r["perplexity_undefended"] == pytest.approx(rows[0]["perplexity"])
    none, noise, rec = rows
    assert not none["defense_trained"] and none["finetune_steps"] == 0 and none["epsilon"] is None
    assert noise["defense_trained"] and noise["finetune_steps"] == 4 and noise["finetune_seconds"] > 0
    assert noise["defense"]["sigma"] == 1.0 and noise["defense"]["clip"] > 0  # the median norm at the cut
    assert noise["epsilon"] == pytest.approx(GaussianNoise(1.0, 1.0).epsilon(1e-5, tokens=16))
    ft = noise["finetune"]
    per_token = math.ceil(ft["windows_sent"] * 16 / ft["tokens"])
    assert noise["releases_finetune"] == per_token * 16 and noise["epsilon_finetune"] >= noise["epsilon"]
    assert noise["perplexity_test_time"] is not None
    preset = recommended("u", (1, 3))
    assert rec["defense"] == preset.defense(noise["defense"]["clip"], rec["defense"]["grad_clip"]).describe()
    assert rec["finetune_steps"] == 4 and [r["preset"] for r in rows] == [None, None, "recommended"]
    # a second run reads the fine-tuned models from the cache: the same rows
    stamp = sorted(p.stat().st_mtime_ns for p in tmp_path.rglob("finetune.json"))
    assert main(argv) == 0
    assert sorted(p.stat().st_mtime_ns for p in tmp_path.rglob("finetune.json")) == stamp
    again = json.loads(out.read_text())["rows"]
    assert [r["token_recovery"] for r in again] == [r["token_recovery"] for r in rows]
    assert [r["finetune_seconds"] for r in again] == [r["finetune_seconds"] for r in rows]


def test_fine_tuned_rows_are_compared_with_an_undefended_row_trained_as_long(tmp_path, monkeypatch, capsys):
    """A defense fine-tuned N steps is also compared with the undefended model fine-tuned N steps by
    the same command (its ``perplexity_control``, the table's "× undefended trained as long"): the
    extra training alone lowers perplexity, so "× undefended" (the reference before fine-tuning)
    flatters a fine-tuned row. Without that row the command says so."""
    monkeypatch.setenv("SPLITLEARN_CACHE", str(tmp_path))
    out, md = tmp_path / "out.json", tmp_path / "out.md"
    base = ["--model", "tiny", "--train-steps", "3", "--cut", "1,3", "--defense-train-steps", "3",
            "--defense-batch-size", "2", "--defense-seq-len", "16", "--attacks", "linear", "--epochs", "1",
            "--seq-len", "16", "--max-private-tokens", "32", "--no-progress", "--json", str(out), "--markdown", str(md)]
    assert main(base + ["--defense", "none", "--defense", "recommended"]) == 0
    none, control, rec = json.loads(out.read_text())["rows"]
    assert (none["finetune_steps"], control["finetune_steps"], rec["finetune_steps"]) == (0, 3, 3)
    assert control["defense"] == {"name": "none"} and "perplexity_control" not in none
    assert control["perplexity"] != none["perplexity"]  # the 3 steps changed the model
    assert rec["perplexity_control"] == control["perplexity_control"] == control["perplexity"]
    head, _, *lines = md.read_text().splitlines()
    cols = [c.strip() for c in head.strip("|").split("|")]
    at = cols.index("× undefended trained as long")
    cell = [c.strip() for c in lines[2].strip("|").split("|")][at]
    assert cell == f"{rec['perplexity'] / control['perplexity']:.2f}"
    assert [c.strip() for c in lines[0].strip("|").split("|")][at] == ""  # the reference row: no control
    capsys.readouterr()
    assert main(base + ["--defense", "recommended"]) == 0  # no control row: said, no column
    assert "no undefended row fine-tuned 3 steps" in capsys.readouterr().err
    assert "trained as long" not in md.read_text()
    assert "perplexity_control" not in json.loads(out.read_text())["rows"][1]


# -- the residual design ---------------------------------------------------------------------------


def test_residual_design_meter_and_model_classes_agree(tmp_path, tiny_model):
    """Noise-free (sigma 0, a tight clip: the server's input differs from the client's), the model
    classes' loss with the residual design is the meter's; without it, it is not."""
    from serverproc import InprocServerProcess

    from splitlearn.hf.modeling import SplitGPT2LMHeadModel

    ids = public_windows(4)
    cut = (1, 3)
    res, plain = GaussianNoise(0.0, 0.05, residual=True), GaussianNoise(0.0, 0.05)
    with InprocServerProcess(cut) as srv:
        m = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=srv.token, defense=res)
        with torch.no_grad():
            loss_res = m(ids, labels=ids).loss.item()
            m.defense = plain
            loss_plain = m(ids, labels=ids).loss.item()
            m.defense = None
            loss_none = m(ids, labels=ids).loss.item()
        with pytest.raises(ConfigError, match="micro_batches"):
            m.micro_batches = 2
            m.defense = res
        m.remote.close()
    assert loss_res == pytest.approx(math.log(perplexities(tiny_model, cut, ids, res)[0]), rel=1e-4)
    assert loss_plain == pytest.approx(math.log(perplexities(tiny_model, cut, ids, plain)[0]), rel=1e-4)
    assert abs(loss_res - loss_none) < abs(loss_plain - loss_none)  # the clean stream helps
    # a clip nothing reaches and no noise: the residual design is today's split
    loose = GaussianNoise(0.0, 1e6, residual=True)
    assert perplexities(tiny_model, cut, ids, loose)[0] == pytest.approx(perplexities(tiny_model, cut, ids, None)[0],
                                                                         rel=1e-5)


def test_residual_design_needs_a_u_shape(tiny_model):
    from splitlearn.privacy import measure_leakage

    with pytest.raises(ConfigError, match="U-shape"):
        measure_leakage(tiny_model, 2, defense=GaussianNoise(1.0, 1.0, residual=True), attacks=("linear",))


# -- presets and defense specs -------------------------------------------------------------------


def test_recommended_preset():
    p = recommended("u", (1, 5))
    assert isinstance(p, Preset) and p.cut == (1, 5) and p.train_steps > 0
    d = p.defense(clip=2.0, grad_clip=0.5)
    assert d.clip == 2.0 and d.grad_clip == 0.5 and d.describe()["name"].startswith("gaussian")
    assert recommended("2-way", 3).cut == (3,)
    assert recommended("2-way", 3).defense(clip=2.0, grad_clip=0.5).grad_clip is None  # no gradient defense
    with pytest.raises(ConfigError, match="clip"):
        p.defense()
    with pytest.raises(ConfigError, match="grad_clip"):
        p.defense(clip=2.0)
    with pytest.raises(ConfigError, match="unknown split shape"):
        recommended("v", 1)
    with pytest.raises(ConfigError, match="2 cut"):
        recommended("u", 1)


def test_defense_specs_and_the_combination():
    assert parse_defense("gaussian:sigma=2", clip=0.5) == GaussianNoise(2.0, 0.5)
    assert parse_defense("none").describe() == {"name": "none"}
    both = parse_defense("gaussian+nopeek:sigma=1,weight=0.3,clip=2")
    assert isinstance(both, GaussianNoPeek) and isinstance(both, GaussianNoise)
    assert both.describe() == {"name": "gaussian+nopeek", "sigma": 1.0, "clip": 2.0, "weight": 0.3,
                               "unit": "sequence"}
    assert both.epsilon(1e-5, tokens=8) == GaussianNoise(1.0, 2.0).epsilon(1e-5, tokens=8)
    x, h = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    assert torch.equal(both.loss(x, h), NoPeek(weight=0.3).loss(x, h))
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    assert torch.equal(both.apply(h, generator=g1), GaussianNoise(1.0, 2.0).apply(h, generator=g2))
    with pytest.raises(ConfigError, match="NoPeek.weight"):
        parse_defense("gaussian+nopeek:sigma=1,weight=-1", clip=1.0)
    assert parse_defense("gaussian:sigma=1,residual=1", clip=1.0).describe()["residual"] is True


def test_perplexity_without_the_server(tiny_model):
    """U-shape rows say what the client's blocks are worth alone: equal to skipping the server's
    blocks by hand, and reported by measure_leakage."""
    from splitlearn.privacy import measure_leakage
    from splitlearn.privacy.meter import perplexity_without_server
    from splitlearn.model.segments import loss_from_logits

    ids = public_windows(4)
    with torch.no_grad():
        tr = tiny_model.transformer
        h = tr.wte(ids) + tr.wpe(torch.arange(16))[None]
        for i in (0, 3):  # cut (1, 3): the client's blocks
            h = tr.h[i](h)
            h = h[0] if isinstance(h, tuple) else h
        by_hand = math.exp(loss_from_logits(tiny_model.lm_head(tr.ln_f(h)), ids).item())
    assert perplexity_without_server(tiny_model, (1, 3), ids) == pytest.approx(by_hand, rel=1e-4)
    r = measure_leakage(tiny_model, (1, 3), attacks=("linear",), seq_len=16, max_private_tokens=32)
    assert r.perplexity_without_server is not None and r.perplexity_without_server != pytest.approx(r.perplexity)
    assert measure_leakage(tiny_model, 1, attacks=("linear",), seq_len=16,
                           max_private_tokens=32).perplexity_without_server is None
    with pytest.raises(ConfigError, match="U-shape"):
        perplexity_without_server(tiny_model, (2,), ids)


def test_perplexity_with_the_server_update_averaged(tiny_model):
    """U-shape rows say what the server's update is worth about the text: each window's update
    replaced by the mean of the other windows'; identical windows give the split perplexity,
    different ones a different value; the residual design; 2-way and one window refused."""
    from splitlearn.privacy import GaussianNoise, measure_leakage
    from splitlearn.privacy.cli import to_markdown
    from splitlearn.privacy.meter import perplexities, perplexity_mean_update

    ids = public_windows(4)
    same = ids[:1].repeat(3, 1)  # (3, T): one window thrice
    split = perplexities(tiny_model, (1, 3), same, None)[0]
    assert perplexity_mean_update(tiny_model, (1, 3), same) == pytest.approx(split, rel=1e-4)
    assert perplexity_mean_update(tiny_model, (1, 3), ids) != pytest.approx(
        perplexities(tiny_model, (1, 3), ids, None)[0], rel=1e-4)
    d = GaussianNoise(sigma=0.0, clip=1e6, residual=True)  # nothing clipped nor noised: the plain U-shape
    assert perplexity_mean_update(tiny_model, (1, 3), same, d) == pytest.approx(split, rel=1e-4)
    r = measure_leakage(tiny_model, (1, 3), attacks=("linear",), seq_len=16, max_private_tokens=64)
    assert r.perplexity_mean_update is not None
    assert "server's update averaged" in to_markdown({"rows": [r.as_dict()]})
    assert measure_leakage(tiny_model, 1, attacks=("linear",), seq_len=16,
                           max_private_tokens=32).perplexity_mean_update is None
    with pytest.raises(ConfigError, match="U-shape"):
        perplexity_mean_update(tiny_model, (2,), ids)
    with pytest.raises(ConfigError, match=">= 2 windows"):
        perplexity_mean_update(tiny_model, (1, 3), ids[:1])
