"""One model or a clear refusal (issue 51, item 4; issue 52, item 6's config check), against a real
server in this process: at session start the client compares the server's config field by field
and its weights at load part by part (splitlearn/api/fingerprint.py); a client built from another
checkpoint is refused naming what differs, the same checkpoint is accepted after training and a
server restart; a tokenizer that does not fit the model's vocabulary is an error at load."""
import json

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from splitlearn import SplitClient, get_tokenizer, load_model
from splitlearn.api.fingerprint import config_differences, part_of, weight_parts
from splitlearn.api import protocol as P
from splitlearn.errors import ConfigError
from splitlearn.hf import SplitGPT2LMHeadModel, split_model

from serverproc import TOKEN, InprocServerProcess, auth, web

pytestmark = pytest.mark.slow


def test_parts_and_config_fields():
    assert part_of("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert part_of("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert part_of("lm_head.weight") == "lm_head" and part_of("transformer.wte.weight") == "transformer.wte"
    a, b = load_model("tiny"), load_model("tiny", seed=5)
    pa, pb = weight_parts(a.state_dict()), weight_parts(b.state_dict())
    assert set(pa) == set(pb) and [k for k in pa if pa[k] == pb[k]] == ["transformer.ln_f"]  # init: ones, zeros
    assert weight_parts(a.state_dict(), torch.bfloat16) != pa  # made in the dtype given
    base = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=300).to_dict()
    other = {**base, "num_key_value_heads": 4, "vocab_size": 301, "attention_dropout": 0.1,
             "rope_parameters": {**base["rope_parameters"], "rope_theta": 500000.0}, "architectures": ["X"]}
    differ = config_differences(base, other)
    assert [d.split(":")[0] for d in differ] == ["num_key_value_heads", "rope_parameters", "vocab_size"]
    family = config_differences(GPT2Config(n_layer=2).to_dict(), base)
    assert any(d.startswith("model_type: this side 'gpt2', the server 'llama'") for d in family)


def test_another_checkpoint_is_refused_naming_what_differs(tmp_path):
    with InprocServerProcess((1, 3), checkpoint_dir=tmp_path / "ckpt") as srv:
        info = web.get(srv.url + P.INFO, headers=auth(), timeout=30).json()
        assert set(info["fingerprint"]["parts"]) == {"transformer.h.1", "transformer.h.2"}
        with pytest.raises(ConfigError, match=r"the weights at load differ in 2 of the server's 2 parts "
                                              r"\(transformer.h.1, transformer.h.2\)"):
            SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, seed=5)
        with pytest.raises(ConfigError, match="the weights at load differ"):  # SplitClient's own path
            SplitClient(srv.url, "tiny", token=TOKEN, seed=5, device="cpu")
        with pytest.raises(ConfigError, match="the weights at load differ"):  # a model split in place
            split_model(load_model("tiny", seed=5), srv.url, token=TOKEN)
        longer = {**load_model("tiny").config.to_dict(), "n_positions": 128, "layer_norm_epsilon": 1e-6}
        (tmp_path / "longer.json").write_text(json.dumps(longer))
        with pytest.raises(ConfigError, match=r"config differs in layer_norm_epsilon: this side 1e-06, the server "
                                              r"1e-05; n_positions: this side 128, the server 64"):
            SplitGPT2LMHeadModel.from_pretrained(str(tmp_path / "longer.json"), server=srv.url, token=TOKEN)
        same = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, client_id="a").train()
        opt = torch.optim.SGD(same.parameters(), lr=0.5)
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        for _ in range(2):  # the server's weights move on: the fingerprint stays the one at load
            same(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        same.save_pretrained(tmp_path / "split")  # the client's weights trained: the folder keeps the fingerprint
        same.remote.close()
        srv.restart()  # from its checkpoint: trained weights, the fingerprint of those at load
        SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, client_id="b").remote.close()
        back = SplitGPT2LMHeadModel.from_pretrained(tmp_path / "split", server=srv.url, token=TOKEN, client_id="a")
        back.remote.close()
        with pytest.raises(ConfigError, match="the weights at load differ"):
            SplitClient(srv.url, "tiny", token=TOKEN, seed=5, device="cpu")


def test_a_server_of_another_seed_accepts_its_own(tmp_path):
    with InprocServerProcess((2,), extra=["--seed", "5"]) as srv:
        with pytest.raises(ConfigError, match=r"weights at load differ in 3 of the server's 4 parts "
                                              r"\(lm_head, transformer.h.2, transformer.h.3\)"):
            SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN)
        SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, seed=5).remote.close()


def test_a_tokenizer_that_does_not_fit_the_model_is_an_error_at_load(tmp_path):
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "gpt2")  # 50,257 tokens, no tokenizer files
    with pytest.raises(ConfigError, match=r"no tokenizer files .* vocabulary is 50257 tokens: splitlearn's byte "
                                          r"tokenizer \(257 ids\) is not its tokenizer"):
        get_tokenizer(str(tmp_path / "gpt2"))
    get_tokenizer("tiny-stories").save_pretrained(tmp_path / "small")  # 1024 tokens for a 257-token model
    load_model("tiny").config.save_pretrained(tmp_path / "small")
    with pytest.raises(ConfigError, match="has 1024 tokens, the model's vocabulary 257"):
        get_tokenizer(str(tmp_path / "small"))
    load_model("tiny").config.save_pretrained(tmp_path / "bytes")  # a byte model without tokenizer files: fits
    assert len(get_tokenizer(str(tmp_path / "bytes"))) == 257


def test_another_family_is_refused_at_session_start_naming_it(tmp_path):
    """Issue 52 item 6: a client of another family (a tiny Llama) against a GPT-2 server is refused
    before anything is sent, the family named first, then the other fields (sizes, vocabulary...)."""
    from transformers import LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    with InprocServerProcess((1, 3)) as srv:
        with pytest.raises(ConfigError, match=r"config differs in model_type: this side 'llama', the server 'gpt2'; "
                                              r".*hidden_size: this side 32, the server '\(absent\)'.*and \d+ more"):
            SplitGPT2LMHeadModel.from_pretrained(str(tmp_path / "llama"), server=srv.url, token=TOKEN)
