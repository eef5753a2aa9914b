"""The privacy meter on the user's own text (issue 54, item 5): ``python -m splitlearn.privacy
--text FILE`` (split into the attacker's public and the owner's private paragraphs) or
``--public-text FILE --private-text FILE``; the rows are measured on those texts, bad input is one
line and exit 2."""
import json

import pytest

from splitlearn.privacy.cli import main as meter_main
from splitlearn.privacy.meter import split_corpus

FAST = ["--model", "tiny", "--cut", "1", "--attacks", "linear,whitebox", "--seq-len", "16", "--epochs", "3",
        "--no-progress"]
PRIVATE = ("My account number is 4417 1234 5678 9113 and my doctor says the rash is nothing to worry about. "
           "Please do not tell my manager about the interview on Friday.")


def rows(path):
    return json.loads(path.read_text())["rows"]


def test_public_and_private_text_files_are_what_is_measured(tmp_path, capsys):
    pub, priv, out = tmp_path / "public.txt", tmp_path / "private.txt", tmp_path / "r.json"
    pub.write_text("\n\n".join(split_corpus()[0]))
    priv.write_text(PRIVATE)
    assert meter_main([*FAST, "--public-text", str(pub), "--private-text", str(priv), "--json", str(out)]) == 0
    (row,) = rows(out)
    # the private windows are the file's bytes (+ the paragraph break), whole windows of 16
    assert row["private_tokens"] == (len(PRIVATE.encode()) + 2) // 16 * 16
    assert row["attacks"]["whitebox"] == 1.0  # the known weights invert the owner's text exactly
    text = json.loads(out.read_text())["text"]
    assert text["private"] == str(priv) and text["public"] == str(pub) and text["private_paragraphs"] == 1


def test_one_text_file_is_split_into_public_and_private(tmp_path):
    paras = split_corpus()[0][:5] * 2  # 10 paragraphs
    f, out = tmp_path / "mine.txt", tmp_path / "r.json"
    f.write_text("\n\n".join(paras))
    assert meter_main([*FAST, "--text", str(f), "--private-share", "0.2", "--json", str(out)]) == 0
    text = json.loads(out.read_text())["text"]
    assert (text["public_paragraphs"], text["private_paragraphs"]) == (8, 2)
    want = len(("\n\n".join(paras[-2:]) + "\n\n").encode()) // 16 * 16  # the last two paragraphs
    assert rows(out)[0]["private_tokens"] == want


@pytest.mark.parametrize("extra,match", [
    (["--public-text", "{pub}"], "go together"),
    (["--text", "{pub}", "--private-text", "{pub}"], "not both"),
    (["--text", "{missing}"], "cannot read"),
    (["--text", "{one}"], "need 2 or more"),
    (["--text", "{pub}", "--private-share", "1.5"], "share in"),
])
def test_bad_text_arguments_are_one_line_and_exit_2(tmp_path, capsys, extra, match):
    (tmp_path / "pub.txt").write_text("one paragraph.\n\nanother one.")
    (tmp_path / "one.txt").write_text("a single line")
    names = dict(pub=tmp_path / "pub.txt", missing=tmp_path / "nope.txt", one=tmp_path / "one.txt")
    assert meter_main([*FAST, *[a.format(**names) for a in extra]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


def test_a_training_run_reports_the_privacy_it_spent(tmp_path, capsys, monkeypatch):
    """``splitlearn-client train --noise-sigma S`` ends with the epsilon its sends spent (the same
    accounting as the meter's fine-tuned rows: :func:`splitlearn.privacy.spent.spent`); without a
    DP defense, no epsilon is claimed."""
    from splitlearn.client.cli import main as client_main
    from splitlearn.model.data import ByteTokenizer
    from splitlearn.privacy import GaussianNoise
    from splitlearn.privacy.spent import spent
    from splitlearn.procs.localserver import LocalServer

    data = tmp_path / "mine.txt"
    data.write_text(PRIVATE * 4)
    with LocalServer(["--model", "tiny", "--cut", "1", "--cut", "3", "--device", "cpu"]) as srv:
        monkeypatch.setenv("SPLITLEARN_TOKEN", srv.token)
        common = ["train", "--server", srv.url, "--model", "tiny", "--steps", "3", "--batch-size", "2", "--seq-len",
                  "8", "--quiet", "--json", "--data", str(data)]
        assert client_main([*common, "--noise-sigma", "2", "--noise-clip", "1.0"]) == 0
        out, err = capsys.readouterr()
        got = json.loads(out.strip().splitlines()[-1])["privacy"]
        want = spent(GaussianNoise(sigma=2, clip=1.0), windows=3 * 2, seq_len=8,
                     tokens=len(ByteTokenizer().encode(data.read_text())))
        assert got == pytest.approx(want) and 0 < got["epsilon"] < float("inf")
        assert f"privacy spent: epsilon {got['epsilon']:.3g} at delta 1e-05" in err
        assert client_main([*common, "--nopeek", "0.5"]) == 0  # no formal guarantee: none stated
        out, err = capsys.readouterr()
        assert json.loads(out.strip().splitlines()[-1])["privacy"] is None and "no DP defense" in err


def test_no_progress_silences_transformers_loading_bars(tmp_path, capsys, monkeypatch):
    """``--no-progress`` with a trained reference (a checkpoint directory, loaded by transformers,
    whose "Loading weights" bar showed before issue 54); the bars come back after."""
    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("SPLITLEARN_CACHE", str(tmp_path / "cache"))  # a fresh reference, trained and loaded
    assert meter_main([*FAST, "--train-steps", "2", "--max-private-tokens", "32", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err
    assert hf_logging.is_progress_bar_enabled()
