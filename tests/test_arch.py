"""The architecture adapter on every verified family (docs/MODELS.md): a cut model equals the
unsplit one bit for bit (logits, loss, every gradient, left-padded batches, greedy decoding with
each segment's own cache past a sliding window), exported segments load back, bad models are
refused with the reason, and the KV bytes follow num_key_value_heads x head_dim per layer type."""
import copy

import pytest
import torch
import transformers as tf

import families as fam
from splitlearn import ConfigError, export_segments, load_segments, partition
from splitlearn.model.arch import FULL, SLIDING, arch_of, check_causal_lm
from splitlearn.model.segments import labels_from_batch, positions_from_mask

CUTS = [(2,), (1, 3)]


def _unsplit(model, ids, mask, **kw):
    """The unsplit model at the positions a segment derives from the mask (the family's rule)."""
    pos = arch_of(model.config).positions(mask, 0, ids.shape[1])
    return model(ids, attention_mask=mask, position_ids=pos, **kw)


@pytest.mark.parametrize("cuts", CUTS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("name", fam.NAMES)
def test_split_equals_unsplit_logits_loss_and_gradients(name, cuts):
    ref = fam.model(name)
    split = copy.deepcopy(ref)
    ids, mask = fam.padded()
    labels = labels_from_batch(ids, mask)
    out = _unsplit(ref, ids, mask, labels=labels)
    out.loss.backward()
    parts = partition(split, cuts)
    logits = parts(ids, mask)
    assert torch.equal(logits, out.logits)
    loss = parts.loss(ids, mask)
    assert torch.equal(loss, out.loss)
    loss.backward()
    grads = {n: p.grad for n, p in split.named_parameters()}
    checked = 0
    for n, p in ref.named_parameters():
        if p.grad is None:
            assert grads[n] is None, n
            continue
        assert torch.equal(grads[n], p.grad), n
        checked += 1
    assert checked > 10


@pytest.mark.parametrize("cuts", CUTS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("name", fam.NAMES)
def test_greedy_decode_with_each_segments_own_cache(name, cuts):
    """5 greedy steps past the sliding window (4) from a left-padded 7-token prompt: every step's
    logits and tokens equal generate()'s on the unsplit model."""
    model = fam.model(name)
    ids, mask = fam.padded()
    steps = 5
    g = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=fam.PAD)
    parts = partition(model, cuts)
    caches = parts.new_caches()
    m, x, toks = mask.clone(), ids, []
    pos = positions_from_mask(m, x.shape[1])
    with torch.no_grad():
        for step in range(steps):
            h = x
            for i, seg in enumerate(parts):
                h = seg(h, m, caches[i], pos, logits_to_keep=1)  # the first segment's positions
            logits = h[:, -1]
            assert torch.equal(logits, g.logits[step]), f"step {step}"
            x = logits.clone().index_fill_(-1, torch.tensor([2]), -float("inf")).argmax(-1, keepdim=True)
            toks.append(x)  # EOS (2) masked, as min_new_tokens does in generate()
            m = torch.cat([m, torch.ones_like(x)], 1)
            pos = pos[:, -1:] + 1
    assert torch.equal(torch.cat(toks, 1), g.sequences[:, ids.shape[1]:])
    assert len(set(torch.cat(toks, 1).flatten().tolist())) > 1  # outputs vary


@pytest.mark.parametrize("name", ["llama-gqa", "gemma", "gemma2", "opt", "falcon-alibi", "gpt2"])
def test_exported_segments_load_back_equal(name, tmp_path):
    """Rotary frequencies and Gemma's embedding scale (non-persistent buffers) are rebuilt."""
    model = fam.model(name)
    ids, mask = fam.padded()
    export_segments(model, (1, 3), tmp_path)
    segs = load_segments(tmp_path, ["bottom", "trunk", "top"])
    h = ids
    with torch.no_grad():
        for s in segs:
            h = s(h, mask)
        assert torch.equal(h, partition(model, (1, 3))(ids, mask))


def test_state_dict_names_are_the_familys():
    parts = partition(fam.model("llama-gqa"), (1, 3))
    names = set(parts.trunk.hf_state_dict())
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert "model.layers.2.mlp.down_proj.weight" in names
    assert {"lm_head.weight", "model.norm.weight"} <= set(parts.top.hf_state_dict())
    assert "model.embed_tokens.weight" in parts.bottom.hf_state_dict()


def test_layer_types_and_masks_per_type():
    a = arch_of(fam.config("gemma2"))
    assert a.layer_types == [SLIDING, FULL, SLIDING, FULL]
    assert arch_of(fam.config("mistral")).layer_types == [SLIDING] * fam.L  # window, no layer_types
    assert arch_of(fam.config("llama-gqa")).layer_types == [FULL] * fam.L


def test_kv_bytes_follow_kv_heads_head_dim_and_windows():
    llama = arch_of(fam.config("llama-gqa"))  # 2 KV heads x head_dim 8
    assert llama.kv_bytes_per_token(4) == {FULL: fam.L * 2 * 2 * 8 * 4}
    assert llama.kv_bytes(10, 4) == fam.L * 2 * 2 * 8 * 4 * 10
    gpt2 = arch_of(fam.config("gpt2"))  # 2 x d per layer
    assert gpt2.kv_bytes(10, 2, 1, 3) == 2 * 2 * fam.D * 2 * 10
    gemma2 = arch_of(fam.config("gemma2"))  # sliding layers keep 4 tokens
    per = 2 * 2 * 8 * 4
    assert gemma2.kv_bytes(10, 4) == 2 * per * 4 + 2 * per * 10
    falcon = arch_of(fam.config("falcon-alibi"))  # multi-query: one KV head
    assert falcon.kv_heads_and_dim() == (1, fam.D // 4)


def test_encoder_decoder_and_layerless_models_are_refused_with_the_list():
    bart = tf.BartConfig(vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                         decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16)
    with pytest.raises(ConfigError, match="encoder-decoder.*verified: llama"):
        arch_of(bart)
    bert = tf.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=16)
    with pytest.raises(ConfigError, match="cannot find its layers.*verified: llama"):
        arch_of(bert)
    with pytest.raises(ConfigError, match="not a causal LM"):
        check_causal_lm(fam.model("llama-gqa").model)  # the base model, no head
    odd = fam.model("llama-gqa")
    odd.model.layers[1] = torch.nn.Linear(fam.D, fam.D)  # a layer that takes no mask
    with pytest.raises(ConfigError, match="cannot be called alone.*verified: llama"):
        partition(odd, (2,))


def test_learned_positions_past_the_table_are_refused():
    parts = partition(fam.model("opt"), (2,))
    ids = torch.randint(3, fam.V, (1, 3))
    with pytest.raises(ConfigError, match="past max_position_embeddings"):
        parts.bottom(ids, position_ids=torch.tensor([[62, 63, 64]]))
