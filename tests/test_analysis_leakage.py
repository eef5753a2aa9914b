"""--privacy: leakage per cut and sweep point, U-shape pairs, the cheapest cut under
--max-leakage, the plot; bad input -> exit 2."""
import json

import pytest

from splitlearn.analysis.cli import main
from splitlearn.analysis.leakage import PrivacyConfig, recommend_private
from splitlearn.errors import ConfigError

FAST = ["--model", "tiny", "--seq-len", "8", "--repeats", "2", "--warmup", "1", "--no-roofline",
        "--threads", "1", "--privacy-attacks", "linear,whitebox", "--privacy-seq-len", "16",
        "--privacy-max-tokens", "128", "--privacy-epochs", "8"]


def test_sweep_with_privacy_recommends_under_the_bound(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(FAST + ["--sweep", "--link-mbps", "10", "--mode", "train", "--privacy",
                      "--noise-sigma", "4", "--max-leakage", "0.5", "--json", str(out),
                      "--plot", str(tmp_path / "r.png")])
    assert rc == 0
    data = json.loads(out.read_text())["sweep"]
    assert len(data["u_points"]) == 10  # C(5, 2) pairs for 4 blocks
    for p in data["points"]:  # train mode: the labels go to the server
        assert [s["leakage"] for s in p["privacy"]] == [1.0, 1.0]
    u = {tuple(p["cuts"]): p for p in data["u_points"]}
    assert u[(1, 3)]["privacy"][0]["leakage"] >= 0.9  # shallow, undefended
    assert u[(1, 3)]["privacy"][1]["leakage"] < 0.5   # sigma = 4
    assert u[(1, 3)]["bytes"]["float32"] == 4 * 8 * 32 * 4  # 2 cuts x (activations + gradients)
    rec = data["private_recommendation"]
    assert len(rec["cuts"]) == 2 and rec["leakage"] <= 0.5 and rec["defense"]["name"] == "gaussian"
    cheapest = min((p for p in data["u_points"] if p["privacy"][1]["leakage"] <= 0.5),
                   key=lambda p: p["step_ms"])
    assert rec["step_ms"] == pytest.approx(cheapest["step_ms"])
    assert "Recommended under max leakage" in capsys.readouterr().out
    assert (tmp_path / "r_privacy.png").read_bytes()[:4] == b"\x89PNG"


def test_recommend_private_picks_the_cheapest_that_meets_the_bound():
    def pt(cut, ms, leaks):
        return {"cut": cut, "client_ms": ms, "client_macs": 0, "step_ms": ms,
                "privacy": [{"leakage": lk, "perplexity": 10 + i, "perplexity_unsplit": 10,
                             "defense": {"name": "none"} if i == 0 else
                             {"name": "gaussian", "sigma": i, "clip": 1.0}}
                            for i, lk in enumerate(leaks)]}
    sweep = {"mode": "prefill", "points": [pt(0, 1.0, [1.0, 0.6]), pt(1, 2.0, [0.9, 0.2]),
                                           pt(2, 3.0, [0.1, 0.05])]}
    rec = recommend_private(sweep, 0.3)
    assert rec["cuts"] == [1] and rec["defense"]["sigma"] == 1
    assert recommend_private(sweep, 0.01)["cuts"] is None


def test_bad_privacy_input(capsys):
    assert main(FAST + ["--cut", "1", "--max-leakage", "0.5"]) == 2
    assert "--max-leakage needs" in capsys.readouterr().err
    assert main(FAST + ["--cut", "1", "--privacy", "--noise-sigma", "-1"]) == 2
    assert "sigma must be >= 0" in capsys.readouterr().err
    assert main(FAST + ["--cut", "1", "--privacy", "--privacy-attacks", "magic"]) == 2
    assert "unknown attack 'magic'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="max_leakage"):
        PrivacyConfig(max_leakage=1.5)
    with pytest.raises(ConfigError, match="clip must be > 0"):
        PrivacyConfig(sigmas=(1.0,), clip=0.0)
