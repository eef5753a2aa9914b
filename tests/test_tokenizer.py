"""The specs' Hugging Face tokenizers, built offline (splitlearn/model/tokenizer.py, data.get_tokenizer):
what transformers' pipeline, data collators and lm-eval take, for the specs every snippet uses."""
import json

import pytest
import torch
import transformers
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

from splitlearn import ByteTokenizer, get_tokenizer, load_corpus, load_model
from splitlearn.model.data import is_bytes
from splitlearn.hf import SplitGPT2LMHeadModel
from splitlearn.model.loading import list_specs, read_spec
from splitlearn.model.tokenizer import TRAINED, shipped_path, train_bpe

from serverproc import TOKEN, InprocServerProcess

TEXTS = ["Once upon a time there was a dog.", "Héllo wörld, 😀\n\n\tend", ""]


@pytest.mark.parametrize("name", [n for n in list_specs() if "hub_id" not in read_spec(n)])
def test_every_spec_has_a_fast_tokenizer_of_its_vocabulary(name):
    tok = get_tokenizer(name)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == read_spec(name)["vocab_size"]  # every id a token of the model, every token an id
    assert tok.eos_token_id == tok.pad_token_id == read_spec(name)["eos_token_id"] and tok.padding_side == "left"
    for text in TEXTS + [load_corpus()]:
        assert tok.decode(tok.encode(text)) == text  # any text: byte-level, so nothing is unknown


def test_the_byte_specs_encode_as_byte_tokenizer():
    tok = get_tokenizer("tiny-demo")
    assert is_bytes(tok) and not is_bytes(get_tokenizer("tiny-stories"))
    for text in TEXTS:
        assert tok.encode(text) == ByteTokenizer().encode(text)
    b = tok(["ab", "c"], padding=True, return_tensors="pt")
    assert b["input_ids"].tolist() == [[97, 98], [256, 99]] and b["attention_mask"].tolist() == [[1, 1], [0, 1]]


def test_the_shipped_bpe_is_what_its_script_trains():
    for name, (text, vocab_size) in TRAINED.items():
        trained = train_bpe(text.read_text(encoding="utf-8"), vocab_size)
        assert trained.to_str(pretty=True) + "\n" == shipped_path(name).read_text()
        assert len(json.loads(shipped_path(name).read_text())["model"]["vocab"]) == vocab_size


def test_the_stories_bpe_keeps_the_corpus_words_whole():
    tok = get_tokenizer("tiny-stories")
    assert tok.convert_ids_to_tokens(tok.encode("Once upon a time")) == ["Once", "Ġupon", "Ġa", "Ġtime"]
    assert len(tok.encode(load_corpus())) < len(load_corpus()) / 4  # ~1 token a word, not a byte


def test_a_data_collator_pads_and_masks_with_it():
    tok = get_tokenizer("tiny-stories")
    batch = DataCollatorForLanguageModeling(tok, mlm=False)([tok(t) for t in TEXTS[:2]])
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape[0] == 2 and (labels == -100).sum() == (batch["attention_mask"] == 0).sum() > 0
    assert torch.equal(labels[batch["attention_mask"] == 1], ids[batch["attention_mask"] == 1])


def test_pipeline_text_generation_over_the_split_model_offline():
    tok = get_tokenizer("tiny-stories")
    with InprocServerProcess((2, 4), model="tiny-stories") as srv:
        split = SplitGPT2LMHeadModel.from_pretrained("tiny-stories", server=srv.url, token=TOKEN)
        try:
            got = transformers.pipeline("text-generation", model=split, tokenizer=tok)(
                ["Once upon a time", "The dog"], max_new_tokens=8, do_sample=False, batch_size=2)
        finally:
            split.remote.close()
    want = transformers.pipeline("text-generation", model=load_model("tiny-stories"), tokenizer=tok)(
        ["Once upon a time", "The dog"], max_new_tokens=8, do_sample=False, batch_size=2)
    assert got == want
    texts = [r[0]["generated_text"] for r in got]
    assert texts[0].startswith("Once upon a time") and len(texts[0]) > len("Once upon a time")
