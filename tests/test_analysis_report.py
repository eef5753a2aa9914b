"""Text, CSV and Markdown renderings agree with the report they render."""
import csv
import io

import pytest

from splitlearn.analysis import report
from splitlearn.analysis.core import AnalysisConfig, analyze


@pytest.fixture(scope="module")
def data(tiny_model):
    return analyze(AnalysisConfig(cuts=(2,), seq_len=4, repeats=2, warmup=0, roofline=False),
                   model=tiny_model)


def test_csv_rows(data):
    rows = list(csv.DictReader(io.StringIO(report.to_csv(data))))
    n_subs = sum(len(s["submodules"]) for s in data["segments"])
    assert len(rows) == len(data["segments"]) + n_subs
    seg_rows = [r for r in rows if r["name"] == "(segment)"]
    assert [int(r["macs"]) for r in seg_rows] == [s["macs"] for s in data["segments"]]


def test_text_and_markdown(data):
    text = report.to_text(data)
    assert "sum check" in text and "Tied weights" in text and "int8" in text
    md = report.to_markdown(data)
    assert md.startswith("# splitlearn model analysis")
    assert "| bottom | [0, 2) |" in md
