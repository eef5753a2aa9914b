"""Byte tokenizer, left padding, the shipped corpus and language-model batches (offline)."""
import pytest
import torch

from splitlearn import ByteTokenizer, get_tokenizer, load_corpus
from splitlearn.model.data import CORPUS, is_bytes, left_pad, lm_batches


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    for text in ["hello", "", "naïve café — 東京 🚀"]:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    assert len(tok.encode("é")) == 2  # bytes, not characters


def test_decode_skips_the_end_of_text_token():
    tok = ByteTokenizer()
    assert tok.decode([256, *tok.encode("hi"), 256, 256]) == "hi"
    assert tok.vocab_size == 257 and tok.eos_token_id == tok.pad_token_id == 256


def test_left_padding_layout():
    b = left_pad([[1, 2, 3], [4], []], pad_id=9)
    assert b["input_ids"].tolist() == [[1, 2, 3], [9, 9, 4], [9, 9, 9]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert b["input_ids"].dtype == b["attention_mask"].dtype == torch.long


def test_tokenizer_call_pads_on_the_left():
    b = ByteTokenizer()(["abc", "d"])
    assert b["input_ids"].tolist() == [[97, 98, 99], [256, 256, 100]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ByteTokenizer()("ab")["input_ids"].shape == (1, 2)


def test_corpus_ships_and_is_not_empty():
    assert CORPUS.is_file()
    text = load_corpus()
    assert len(text.strip()) > 1000
    assert ByteTokenizer().decode(ByteTokenizer().encode(text)) == text


def test_load_corpus_from_a_path(tmp_path):
    (tmp_path / "c.txt").write_text("some text", encoding="utf-8")
    assert load_corpus(tmp_path / "c.txt") == "some text"


def test_lm_batches_shapes_and_windows():
    ids = list(range(100))
    batches = list(lm_batches(ids, batch_size=3, seq_len=8, steps=5))
    assert len(batches) == 5
    for b in batches:
        assert b.shape == (3, 8) and b.dtype == torch.long
        assert (b[:, 1:] - b[:, :-1] == 1).all()  # contiguous windows of the stream
        assert int(b.max()) < 100


def test_lm_batches_are_reproducible_for_a_seed():
    ids = ByteTokenizer().encode(load_corpus())
    a = list(lm_batches(ids, 4, 16, seed=3, steps=3))
    b = list(lm_batches(ids, 4, 16, seed=3, steps=3))
    c = list(lm_batches(ids, 4, 16, seed=4, steps=3))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_lm_batches_run_forever_without_steps():
    it = lm_batches(list(range(50)), 2, 4)
    assert len([next(it) for _ in range(20)]) == 20


def test_lm_batches_refuse_a_corpus_shorter_than_a_window():
    with pytest.raises(ValueError, match="fewer than seq_len"):
        next(lm_batches(list(range(8)), 2, 8))


@pytest.mark.parametrize("source", [None, "tiny", "tiny-demo", "random:gpt2"])
def test_get_tokenizer_gives_bytes_for_specs(source):
    tok = get_tokenizer(source)
    assert is_bytes(tok) and not isinstance(tok, ByteTokenizer)  # a transformers tokenizer of the same ids
    assert tok.encode("é!") == ByteTokenizer().encode("é!") == [195, 169, 33]


def test_get_tokenizer_gives_bytes_for_a_json_config(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text("{}")
    assert is_bytes(get_tokenizer(str(path)))


def test_get_tokenizer_for_a_checkpoint_without_tokenizer_files(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    assert is_bytes(get_tokenizer(str(tmp_path)))


def test_get_tokenizer_loads_a_local_hugging_face_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3}
    bpe = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(tmp_path)
    tok = get_tokenizer(str(tmp_path))
    assert not is_bytes(tok)
    assert tok.padding_side == "left" and tok.pad_token == tok.eos_token
    b = tok(["ab a", "b"], padding=True)
    assert b["input_ids"] == [[3, 1], [0, 2]] and b["attention_mask"] == [[1, 1], [0, 1]]
