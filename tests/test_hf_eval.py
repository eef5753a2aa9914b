"""Real clients, unchanged, on the split model (issue 33, item 4): ``transformers.pipeline``
and lm-evaluation-harness' ``HFLM``, against the server in this process
(tests/serverproc.py's InprocServerProcess), offline.

One server per shape (U-shape cuts (1, 3), 2-way cut 2) holding the seeded init of
models/tiny-varied.json (its outputs vary); the unsplit reference is that model. The tokenizer
is built locally (``byte_tokenizer``). The wire is float32: greedy text is the unsplit model's
exactly, log-likelihoods within float32 rounding.
"""
import json
import math
import os

import pytest
import transformers
from transformers.testing_utils import CaptureLogger

from splitlearn.hf import SplitGPT2LMHeadModel

from conftest import VARIED
from serverproc import TOKEN, InprocServerProcess
from test_hf_generation import byte_tokenizer

pytestmark = pytest.mark.slow

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # lm-eval loads its task's data with `datasets`
# lm-eval sets HF_XET_HIGH_PERFORMANCE when imported: import it here, at collection (before any
# test server's fork server starts in this worker), so the environment the fork server was
# started with stays the one its children ask for (tests/forkserver.py starts a child whose
# startup environment differs afresh, and tests/test_localserver.py checks the preloaded path)
lm_eval = pytest.importorskip("lm_eval")
import lm_eval.evaluator  # noqa: E402,F401
import lm_eval.models.huggingface  # noqa: E402,F401

RTOL, ATOL = 1e-5, 1e-4  # float32 sums over up to a few hundred tokens
PROMPTS = ["Once upon a time", "Hi", "The cat sat on the mat."]
# longer than tiny-varied's 64 positions: the rolling log-likelihood goes in windows
LONG = "Split learning cuts a model in two; the data owner keeps the ends and the server the middle. " * 2


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module", params=[(1, 3), (2,)], ids=["u", "2way"])
def split_lm(request):
    with InprocServerProcess(request.param, model=VARIED) as srv:
        model = SplitGPT2LMHeadModel.from_pretrained(VARIED, server=srv.url, token=TOKEN)
        yield model
        model.remote.close()


def test_pipeline_generates_the_unsplit_models_text(split_lm, varied_model, tok):
    pipe_log = transformers.logging.get_logger("transformers.pipelines.base")
    with CaptureLogger(pipe_log) as log:
        split_pipe = transformers.pipeline("text-generation", model=split_lm, tokenizer=tok)
    assert "not supported" not in log.out  # transformers knows it as a causal LM
    ref_pipe = transformers.pipeline("text-generation", model=varied_model, tokenizer=tok)
    for kw in (dict(do_sample=False), dict(num_beams=3, do_sample=False)):
        # batch_size=2: the pipeline left-pads two prompts of different lengths together
        got = split_pipe(PROMPTS, max_new_tokens=10, batch_size=2, **kw)
        want = ref_pipe(PROMPTS, max_new_tokens=10, batch_size=2, **kw)
        assert got == want
        texts = [r[0]["generated_text"] for r in got]
        assert all(t.startswith(p) and len(t) > len(p) for t, p in zip(texts, PROMPTS))
        assert len(set(t[len(p):] for t, p in zip(texts, PROMPTS))) == len(PROMPTS)  # they vary


def hflm(model, tok):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tok, batch_size=3)


def test_hflm_loglikelihood_and_rolling_equal_the_unsplit_model(split_lm, varied_model, tok):
    from lm_eval.api.instance import Instance

    pairs = [("Once upon", " a time"), ("The cat", " sat on the mat."), ("Hi", "!"), ("", LONG[:40])]
    ll = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate([LONG, "Hello world"])]
    got_ll, want_ll = (hflm(m, tok).loglikelihood(ll) for m in (split_lm, varied_model))
    for (g, g_greedy), (w, w_greedy) in zip(got_ll, want_ll):
        assert math.isclose(g, w, rel_tol=RTOL, abs_tol=ATOL), (got_ll, want_ll)
        assert g_greedy == w_greedy
    assert len({round(w, 3) for w, _ in want_ll}) == len(pairs)
    got_r, want_r = (hflm(m, tok).loglikelihood_rolling(rolling) for m in (split_lm, varied_model))
    assert len(tok(LONG)["input_ids"]) > varied_model.config.n_positions  # several windows
    assert got_r == pytest.approx(want_r, rel=RTOL, abs=ATOL)


TASKS = {
    "tiny_ppl": dict(output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
                     metric_list=[dict(metric=m, aggregation=a, higher_is_better=False) for m, a in
                                  (("word_perplexity", "weighted_perplexity"),
                                   ("byte_perplexity", "weighted_perplexity"), ("bits_per_byte", "bits_per_byte"))]),
    "tiny_mc": dict(output_type="multiple_choice", doc_to_text="{{question}}", doc_to_choice="{{choices}}",
                    doc_to_target="{{answer}}",
                    metric_list=[dict(metric="acc", aggregation="mean", higher_is_better=True)]),
}
ROWS = [dict(text=LONG, question="The cat sat on the", choices=[" mat", " hat", " roof"], answer=0),
        dict(text="Once upon a time there was a model.", question="Once upon a", choices=[" time", " tree"], answer=1),
        dict(text="Hello world", question="2 + 2 =", choices=[" 4", " 5", " 22"], answer=2)]


def test_lm_eval_simple_evaluate_on_a_local_task(split_lm, varied_model, tok, tmp_path):
    """docs/EVALUATION.md's recipe: a task YAML over a local jsonl file, run by simple_evaluate."""
    import lm_eval
    import yaml
    from lm_eval.tasks import TaskManager

    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    for name, spec in TASKS.items():
        cfg = dict(task=name, dataset_path="json", dataset_kwargs=dict(data_files=dict(test=str(data))),
                   test_split="test", metadata=dict(version=1.0), **spec)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)
    got, want = (lm_eval.simple_evaluate(model=hflm(m, tok), tasks=list(TASKS), task_manager=tasks,
                                         log_samples=False)["results"] for m in (split_lm, varied_model))
    for name, metric in (("tiny_ppl", "byte_perplexity,none"), ("tiny_ppl", "bits_per_byte,none"),
                         ("tiny_ppl", "word_perplexity,none"), ("tiny_mc", "acc,none")):
        assert math.isfinite(want[name][metric])
        assert got[name][metric] == pytest.approx(want[name][metric], rel=1e-4), (name, metric)
    assert want["tiny_ppl"]["byte_perplexity,none"] > 1
