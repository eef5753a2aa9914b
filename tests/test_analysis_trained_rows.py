"""--privacy-rows: the planner chooses among rows the meter measured (defenses fine-tuned in),
counts the U-shape's gradient channel in train mode, and refuses rows it cannot use."""
import json

import pytest

from splitlearn.analysis.cli import main
from splitlearn.analysis.leakage import PrivacyConfig, annotate_sweep, leakage, load_rows
from splitlearn.errors import ConfigError

FAST = ["--model", "tiny", "--seq-len", "8", "--repeats", "2", "--warmup", "1", "--no-roofline",
        "--threads", "1"]


def row(cut, name="none", rec=1.0, ppl=9.0, trained=0, grad=None, knows="finetuned", **d):
    return {"cut": list(cut), "defense": {"name": name, **d}, "token_recovery": rec, "best_attack": "mlp",
            "perplexity": ppl, "perplexity_unsplit": 9.0, "perplexity_undefended": 9.0, "epsilon": None,
            "labels_reach_server": len(cut) == 1, "defense_trained": bool(trained), "finetune_steps": trained,
            "token_recovery_gradient": grad, "attacker_knows": knows, "preset": None}


ROWS = [row((1, 3)),
        row((1, 3), "gaussian", 0.22, 120.0, sigma=4, clip=2.4),                 # at test time
        row((1, 3), "gaussian", 0.19, 9.2, 200, sigma=4, clip=2.4, residual=True),  # fine-tuned
        row((1, 3), "none", 0.8, 8.5, 200, knows="public"),                      # a secret client
        row((1,)), row((1,), "gaussian", 0.19, 18.0, 200, sigma=4, clip=2.4)]


def sweep(mode):
    return {"mode": mode, "points": [{"cut": 1, "client_ms": 1.0, "client_macs": 1, "step_ms": 1.0}],
            "u_points": [{"cuts": [1, 3], "client_ms": 2.0, "client_macs": 2, "step_ms": 2.0}]}


def test_the_planner_picks_the_fine_tuned_row():
    rows = load_rows({"model": "tiny", "rows": ROWS}, "tiny")
    assert len(rows) == 5 and all(r["attacker_knows"] == "finetuned" for r in rows)  # public left out
    s = annotate_sweep(sweep("prefill"), None, PrivacyConfig(max_leakage=0.25, rows=rows))  # nothing measured
    u = s["u_points"][0]["privacy"]
    assert [p["source"] for p in u] == ["file"] * 3 and u[2]["defense_trained"]
    rec = s["private_recommendation"]  # the 2-way cut is cheaper and meets the bound at 18.0
    assert rec["cuts"] == [1] and rec["defense_trained"] and rec["finetune_steps"] == 200
    s = annotate_sweep(sweep("train"), None, PrivacyConfig(max_leakage=0.25, rows=rows))
    rec = s["private_recommendation"]  # train: the labels rule the 2-way cut out
    assert rec["cuts"] == [1, 3] and rec["perplexity"] == 9.2 and rec["defense"]["residual"]
    assert "fine-tuned 200 steps" in rec["reason"] and "residual" in rec["reason"]
    assert rec["gradient_measured"] is False and "NOT measured" in rec["reason"]  # ROWS carry none


def test_the_gradient_channel_counts_in_training():
    r = row((1, 3), "gaussian", 0.19, 9.2, 200, grad=0.99, sigma=4, clip=2.4, residual=True)
    assert leakage(r, "prefill") == 0.19 and leakage(r, "train") == 0.99
    rows = load_rows([row((1,)), r])
    s = annotate_sweep(sweep("train"), None, PrivacyConfig(max_leakage=0.25, rows=rows))
    assert s["private_recommendation"]["cuts"] is None  # nothing holds once the gradient is counted
    assert "through the gradient at the second cut (recovery up to 0.990)" in s["private_recommendation"]["reason"]
    low = dict(r, token_recovery_gradient=0.2)
    s = annotate_sweep(sweep("train"), None, PrivacyConfig(max_leakage=0.25, rows=load_rows([row((1,)), low])))
    assert s["private_recommendation"]["gradient_measured"] is True
    assert "NOT measured" not in s["private_recommendation"]["reason"]


def test_cli_uses_the_rows_at_their_cuts(tmp_path, capsys):
    f = tmp_path / "rows.json"
    f.write_text(json.dumps({"model": "tiny", "rows": ROWS}))
    out = tmp_path / "r.json"
    assert main(FAST + ["--cut", "1", "--cut", "3", "--privacy", "--privacy-rows", str(f), "--json", str(out)]) == 0
    got = json.loads(out.read_text())["privacy"]
    assert [r["perplexity"] for r in got] == [9.0, 120.0, 9.2]  # the file's rows, none measured
    assert "fine-tuned 200 steps with it" in capsys.readouterr().out


@pytest.mark.parametrize("data,match", [
    ({"model": "tiny-demo", "rows": ROWS}, "measured on 'tiny-demo'"),
    ({"model": "tiny", "rows": []}, "no rows"),
    ({"model": "tiny", "rows": [{"cut": [1]}]}, "lacks defense"),
])
def test_bad_rows(data, match):
    with pytest.raises(ConfigError, match=match):
        load_rows(data, "tiny")


def test_bad_rows_on_the_command_line(tmp_path, capsys):
    assert main(FAST + ["--cut", "1", "--privacy-rows", str(tmp_path / "x.json")]) == 2
    assert "--privacy-rows needs --privacy" in capsys.readouterr().err
    assert main(FAST + ["--cut", "1", "--privacy", "--privacy-rows", str(tmp_path / "x.json")]) == 2
    assert "cannot read privacy rows" in capsys.readouterr().err


def test_rows_of_several_files_merge(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    fine = dict(sigma=4, clip=2.4, residual=True)
    a.write_text(json.dumps({"model": "tiny", "rows": [row((1, 3), "gaussian", 0.19, 9.2, 200, **fine)]}))
    b.write_text(json.dumps({"model": "tiny", "rows": [row((1, 3), "gaussian", 0.18, 9.2, 200, grad=0.99, **fine),
                                                       row((1, 3), "none", 1.0, 8.9, 200, grad=1.0)]}))
    rows = load_rows([str(a), str(b)], "tiny")
    assert len(rows) == 2
    assert rows[0]["token_recovery"] == 0.19 and rows[0]["token_recovery_gradient"] == 0.99
