"""``make demo`` (splitlearn/apps/demo.py), shortened: the split model trains as the unsplit one (the
same sample for the same seed, on lines ``split:`` and ``unsplit:``) and its sample is made of
words of the corpus."""
import torch

from splitlearn.apps import demo
from splitlearn import get_tokenizer, load_corpus, load_model

PROMPT = "Once upon a time"


def sample_line(out: str, tag: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith(tag + ":")]
    assert len(lines) == 1, out
    return lines[0][len(tag) + 1:].strip()


def test_the_demo_trains_split_as_unsplit_and_speaks_words(capsys):
    rc = demo.main(["--steps", "20", "--batch-size", "8", "--fed-rounds", "0", "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    split, unsplit = sample_line(out, "split"), sample_line(out, "unsplit")
    assert split.startswith(PROMPT) and len(split) > len(PROMPT) + 20
    assert split == unsplit  # the proof: the same weights on both sides of the cut
    share = demo.word_share(split[len(PROMPT):], load_corpus())
    assert share >= 0.7, split
    assert "held-out loss (split)" in out and rc == 0  # the held-out loss went down, both samples equal

    # the criterion bites: the untrained model's sample, same seed and settings, is not words
    tok = get_tokenizer(demo.MODEL)
    prompt = torch.tensor([tok.encode(PROMPT)])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ids = load_model(demo.MODEL).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                                             pad_token_id=0, top_p=1.0, **demo.SAMPLING)
    assert demo.word_share(tok.decode(ids[0], skip_special_tokens=True)[len(PROMPT):], load_corpus()) < 0.7
