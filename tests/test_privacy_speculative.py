"""The speculative-decoding releases as an attack (splitlearn.privacy.speculative, captured by
splitlearn.apps.defensetrain.speculative_releases over the model classes and an in-process server):
every position the server receives is recorded, rejected drafts included, the count is
CountingRemoteCache's, the output is the unsplit model's greedy output, and the meter's attacks read
the releases back — all of them undefended, far fewer with noise."""
import json

import pytest
import torch

from splitlearn import load_model
from splitlearn.model.data import ByteTokenizer
from splitlearn.apps.defensetrain import main, speculative_releases
from splitlearn.errors import ConfigError
from splitlearn.privacy import AttackConfig, GaussianNoise
from splitlearn.privacy.meter import median_token_norm, private_windows
from splitlearn.privacy.speculative import attack_releases

from conftest import VARIED  # initialised with std 0.3: its greedy tokens vary

CUT = (1, 3)
NEW = 12


@pytest.fixture(scope="module")
def varied():
    return load_model(VARIED)


@pytest.fixture(scope="module")
def prompts():
    return private_windows(ByteTokenizer(), seq_len=24)[:2, :12].tolist()  # two private prompts of 12


@pytest.fixture(scope="module")
def undefended(prompts):
    return speculative_releases(VARIED, CUT, None, prompts, new_tokens=NEW, draft="free", draft_tokens=4)


def test_every_position_sent_is_captured_and_counted(undefended, varied, prompts):
    rel = undefended
    assert rel.released == rel.positions_sent  # CountingRemoteCache's own count
    for out, p in zip(rel.outputs, prompts):  # greedy over the split = the unsplit model's greedy
        want = varied.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, pad_token_id=256)[0]
        assert torch.equal(out, want)
    assert rel.released_plain == sum(len(o) - 1 for o in rel.outputs)
    kept = rel.kept_mask()
    # the free draft (blocks 0 and 3 of a random model) disagrees often: drafts are rejected, and
    # every position beyond what plain decoding sends is one of them
    assert rel.released > rel.released_plain
    assert int(kept.sum()) == rel.released_plain and int((~kept).sum()) == rel.released - rel.released_plain
    # the kept positions carry the output's tokens, in order, each once per generation
    for i, out in enumerate(rel.outputs):
        got = {past + j: int(t) for (q, past, h, ids), m in _per_step(rel, kept) if q == i
               for j, (t, k) in enumerate(zip(ids, m)) if k}
        assert got == {t: int(out[t]) for t in range(len(out) - 1)}


def _per_step(rel, kept):
    i = 0
    for step in rel.steps:
        n = len(step[3])
        yield step, kept[i:i + n].tolist()
        i += n


def test_the_attack_reads_the_releases_back_and_noise_hides_them(undefended, varied, prompts):
    tok = ByteTokenizer()
    cfg = AttackConfig(epochs=2)
    r = attack_releases(varied, CUT, None, undefended, tokenizer=tok, attacks=("linear", "whitebox"), config=cfg)
    assert r["released"] == undefended.positions_sent and r["rejected_drafts"] == r["released_beyond_plain"] > 0
    # white-box, as the server runs it (the kept prefix, cropped at each step): everything, the
    # never-emitted drafts included (chance: about 1/257)
    assert r["best_attack"] == "whitebox" and r["token_recovery"] == 1.0
    assert r["token_recovery_rejected"] == 1.0 and r["token_recovery_kept"] == 1.0
    assert r["epsilon"] is None
    d = GaussianNoise(sigma=4.0, clip=median_token_norm(varied, CUT, tokenizer=tok))
    rel = speculative_releases(VARIED, CUT, d, prompts, new_tokens=NEW, draft="free", draft_tokens=4)
    assert rel.released == rel.positions_sent
    n = attack_releases(varied, CUT, d, rel, tokenizer=tok, attacks=("linear", "whitebox"), config=cfg)
    assert n["token_recovery"] < 0.5
    per_prompt = max(sum(len(s[3]) for s in rel.steps if s[0] == i) for i in range(len(prompts)))
    assert n["epsilon"] == pytest.approx(d.epsilon(1e-5, steps=1, tokens=per_prompt))
    assert n["epsilon"] > n["epsilon_plain"]  # the drafts are releases too


def test_bad_input_is_refused(prompts):
    with pytest.raises(ConfigError, match="U-shape"):
        speculative_releases(VARIED, (2,), None, prompts, draft="free")
    with pytest.raises(ConfigError, match="free or lookup"):
        speculative_releases(VARIED, CUT, None, prompts, draft="other")
    with pytest.raises(ConfigError, match="attack"):
        attack_releases(load_model(VARIED), CUT, None, None, tokenizer=ByteTokenizer(), attacks=("gru",))


def test_the_command_adds_the_speculative_field(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = main(["--model", VARIED, "--cut", "1,3", "--attacks", "linear", "--epochs", "1",
               "--max-private-tokens", "32", "--speculative-attack", "--speculative-prompts", "1",
               "--speculative-new-tokens", "8", "--no-progress", "--json", str(out)])
    assert rc == 0
    row = json.loads(out.read_text())["rows"][0]
    s = row["speculative"]
    assert s["draft"] == "free" and s["prompts"] == 1 and s["released"] == s["positions_sent"]
    assert s["released"] == s["released_plain"] + s["released_beyond_plain"]
    assert "speculative: released" in capsys.readouterr().out
    assert main(["--model", VARIED, "--cut", "2", "--speculative-attack", "--speculative-draft", "free"]) == 2


def test_a_two_way_cut_drafts_by_prompt_lookup(prompts):
    rel = speculative_releases(VARIED, (2,), None, [prompts[0] * 2], new_tokens=NEW, draft="lookup", draft_tokens=3)
    assert rel.draft == "lookup" and rel.released == rel.positions_sent
    assert int(rel.kept_mask().sum()) == rel.released_plain
