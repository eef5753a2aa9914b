"""load_model / load_config: every kind of source, seeded random inits, dtype and device."""
import json

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from splitlearn import ConfigError, load_config, load_model
from splitlearn.model.loading import is_spec_source, list_specs, read_spec, specs_dir

TINY = dict(vocab_size=257, n_positions=32, n_embd=16, n_layer=2, n_head=2)


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_shipped_specs_are_gpt2_configs():
    assert {"tiny", "tiny-demo", "gpt2"} <= set(list_specs())
    for name in list_specs():
        cfg = load_config(f"random:{name}")
        assert isinstance(cfg, GPT2Config) and cfg.n_embd % cfg.n_head == 0, name
    assert specs_dir().name in ("models", "_models")


def test_tiny_spec_builds_the_tiny_model(tiny_model):
    spec = read_spec("tiny")
    cfg = tiny_model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.vocab_size) == (spec["n_layer"], spec["n_embd"], 257)
    assert isinstance(tiny_model, GPT2LMHeadModel) and not tiny_model.training
    assert tiny_model.lm_head.weight is tiny_model.transformer.wte.weight


def test_random_prefix_gives_the_gpt2_shape_without_weights():
    cfg = load_config("random:gpt2")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size) == (12, 768, 12, 50257)
    assert is_spec_source("random:gpt2") and not is_spec_source("gpt2")  # bare name: the hub
    assert is_spec_source("tiny")  # a spec without hub_id is random by its bare name


def test_seeded_random_init_is_identical_across_loads():
    a, b = load_model("tiny"), load_model("tiny")
    assert same_weights(a, b)
    assert not same_weights(a, load_model("tiny", seed=1))


def test_random_init_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    load_model("tiny")
    assert torch.equal(torch.rand(2), expected)


def test_from_a_gpt2_config():
    model = load_model(GPT2Config(**TINY))
    assert model.config.n_layer == 2 and model.transformer.wte.weight.shape == (257, 16)
    assert same_weights(model, load_model(GPT2Config(**TINY)))


def test_from_a_json_config_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"model_type": "gpt2", **TINY}))
    assert load_config(path).n_embd == 16
    assert same_weights(load_model(path), load_model(GPT2Config(**TINY)))


def test_from_a_save_pretrained_directory(tiny_model, tmp_path, batch):
    tiny_model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert load_config(tmp_path).n_layer == tiny_model.config.n_layer
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).logits, tiny_model(batch).logits, rtol=0, atol=0)


def test_a_model_passes_through(tiny_model):
    assert load_model(tiny_model) is tiny_model


def test_dtype_and_device():
    model = load_model("tiny", dtype="bfloat16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert next(load_model("tiny", dtype=torch.float16).parameters()).dtype == torch.float16
    assert next(load_model("tiny").parameters()).dtype == torch.float32


def test_unknown_dtype_is_refused():
    with pytest.raises(ConfigError, match="unknown dtype 'int8'"):
        load_model("tiny", dtype="int8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        load_model("tiny", device="cuda")


# -- refused sources ---------------------------------------------------------------------

def test_non_gpt2_json_config_is_refused(tmp_path):
    path = tmp_path / "bert.json"
    path.write_text(json.dumps({"model_type": "bert", "hidden_size": 16}))
    for load in (load_config, load_model):
        with pytest.raises(ConfigError, match="model_type is 'bert'"):
            load(path)


def test_non_gpt2_checkpoint_directory_is_refused(tmp_path):
    cfg = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=16)
    BertModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="model_type is 'bert'"):
        load_model(tmp_path)


def test_directory_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize("module", [nn.Linear(4, 4), GPT2LMHeadModel(GPT2Config(**TINY)).transformer],
                         ids=["linear", "gpt2-base"])
def test_a_module_that_is_not_a_gpt2_lm_is_refused(module):
    """Refused with the reason and the supported families."""
    with pytest.raises(ConfigError, match="causal (language models|LM).*verified: llama"):
        load_model(module)


def test_unknown_random_spec_is_refused():
    with pytest.raises(ConfigError, match="no model spec named 'nope'.*tiny"):
        load_config("random:nope")


def test_missing_json_config_is_refused_without_the_hub(tmp_path):
    for load in (load_config, load_model):
        with pytest.raises(ConfigError, match="does not exist"):
            load(tmp_path / "missing.json")
