"""Tiny random configs of every family the adapter is verified on (docs/MODELS.md), built offline.

Width 32, 4 layers, a 96-token vocabulary, ``initializer_range`` 0.3 so that greedy tokens vary
(a cache that drifts shows as wrong tokens); sliding families get a window of 4, shorter than the
test sequences, so decoding runs past it.
"""
import torch
import transformers as tf

V, D, L = 96, 32, 4
PAD = 0
COMMON = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, intermediate_size=64, max_position_embeddings=64,
              pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.3)

CONFIGS = {
    "llama-mha": (tf.LlamaConfig, dict(COMMON, num_attention_heads=2, num_key_value_heads=2)),
    "llama-gqa": (tf.LlamaConfig, dict(COMMON, num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": (tf.Qwen2Config, dict(COMMON, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": (tf.Qwen3Config, dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=8)),
    "mistral": (tf.MistralConfig, dict(COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=4)),
    "gemma": (tf.GemmaConfig, dict(COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=8)),
    "gemma2": (tf.Gemma2Config, dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     sliding_window=4, attn_implementation="eager")),
    "gemma3": (tf.Gemma3TextConfig, dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         sliding_window=4, sliding_window_pattern=2)),
    "phi3": (tf.Phi3Config, dict(COMMON, num_attention_heads=4, num_key_value_heads=2)),
    "gpt_neox": (tf.GPTNeoXConfig, dict(COMMON, num_attention_heads=4, rotary_pct=0.5)),
    "opt": (tf.OPTConfig, dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, ffn_dim=64, num_attention_heads=4,
                               max_position_embeddings=64, word_embed_proj_dim=D, pad_token_id=PAD, bos_token_id=1,
                               eos_token_id=2, init_std=0.3, dropout=0.0)),
    "falcon-alibi": (tf.FalconConfig, dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=4,
                                           new_decoder_architecture=False, parallel_attn=True, alibi=True,
                                           multi_query=True, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
                                           initializer_range=0.3)),
    "falcon": (tf.FalconConfig, dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=4,
                                     new_decoder_architecture=True, num_kv_heads=2, alibi=False, pad_token_id=PAD,
                                     bos_token_id=1, eos_token_id=2, initializer_range=0.3)),
    "gpt2": (tf.GPT2Config, dict(vocab_size=V, n_embd=D, n_layer=L, n_head=4, n_positions=64, pad_token_id=PAD,
                                 bos_token_id=1, eos_token_id=2, initializer_range=0.3, resid_pdrop=0.0,
                                 embd_pdrop=0.0, attn_pdrop=0.0)),
}
NAMES = list(CONFIGS)


def config(name: str):
    cls, kw = CONFIGS[name]
    return cls(**kw)


def model(name: str, seed: int = 0):
    """A seeded random model of family ``name``, in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return tf.AutoModelForCausalLM.from_config(config(name)).eval()


def padded(batch: int = 2, length: int = 7, pad: int = 3, seed: int = 0):
    """(input_ids, attention_mask) (batch, length): row 0 left-padded by ``pad``, the rest full."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    ids[0, :pad] = PAD
    return ids, mask
