"""The whole model out of a split one, and what a split model's own folder is (issue 51, item 3).

    unsplit = model.merge_and_unload()        # peft's word: the family's plain transformers model
    unsplit.save_pretrained(out)              # AutoModelForCausalLM.from_pretrained(out): the same logits

:func:`merge_and_unload` sends the last step's apply (:meth:`flush`), reads the server's segment
*as it is now* (``GET /v1/clients/<id>/weights``: safetensors, the server's Hugging Face names;
with a LoRA server, this client's own server-side adapter beside them), builds the plain class
from the config (``AutoModelForCausalLM.from_config`` for a causal LM: the family's class from the
config's ``model_type``; the split class's ``HF_CLASS`` for other heads), loads the client's
weights and the server's into it, and adds every LoRA adapter (both sides') into its base weight
(``W += scale * B @ A``, transposed for a ``Conv1D``). A 2-way server's LM head is its own copy
of the embeddings, trained apart: the merged config unties them. The server answers only where
its operator allows it (``--allow-weight-export``: by default a server with one tenant does, one
with several does not; a refusal is a 403 that says so).

A split model's own ``save_pretrained`` folder holds the client's weights only. Its
``config.json`` names the model type :data:`SPLIT_MODEL_TYPE` (the family's own kept under
``"splitlearn"``), so ``AutoModelForCausalLM.from_pretrained`` refuses it instead of loading the
server's blocks randomly initialised: with splitlearn imported, by :class:`SplitFolderConfig`'s
message (how to load it and how to get the whole model), without it by transformers' "does not
recognize this architecture". The split class's ``from_pretrained`` loads it back
(:func:`load_split_folder`), the fingerprint of the weights at load kept in its config.
"""
from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Optional

import torch
from transformers import AutoConfig, PretrainedConfig

from ..api import protocol as P
from ..api.wire import decode
from ..errors import ConfigError
from ..model.loading import _LOAD_LOCK
from ..model.lora import LoraSpec

log = logging.getLogger(__name__)

SPLIT_MODEL_TYPE = "splitlearn-split-client"  # config.json's model_type in a split model's own folder
SPLIT_KEY = "splitlearn"  # config.json: {"model_type": the family's, "cuts": [...], "client_only": true}
CLIENT_FILE_STEM = "splitlearn_client"  # a split folder's weights: splitlearn_client.safetensors (not model.*)
PEFT_PREFIX = "base_model.model."  # an adapter tensor's name in the weights answer (peft's saved names)


def _refusal(where: str = "this folder") -> str:
    return (f"{where} holds a split model's client side only (splitlearn save_pretrained): the server's blocks "
            f"are not in it. Load it back with splitlearn's split class (SplitGPT2LMHeadModel.from_pretrained"
            f"(folder, server=URL, ...)); for the whole model, save model.merge_and_unload() "
            f"(unsplit.save_pretrained(folder)), or train with --export-merged DIR")


class SplitFolderConfig(PretrainedConfig):
    """What ``AutoConfig`` finds for :data:`SPLIT_MODEL_TYPE`: a refusal with the way out."""

    model_type = SPLIT_MODEL_TYPE

    def __init__(self, **kwargs):
        raise ConfigError(_refusal(kwargs.get("_name_or_path") or "this folder"))


try:
    AutoConfig.register(SPLIT_MODEL_TYPE, SplitFolderConfig)
except ValueError:  # registered already (a module reloaded)
    pass


# -- a split model's own folder ------------------------------------------------------------

def mark_split_folder(directory, config, cuts) -> None:
    """Make ``directory`` (just written by ``save_pretrained``) a split model's folder: its
    ``config.json`` names the model type :data:`SPLIT_MODEL_TYPE` (the family's kept under
    :data:`SPLIT_KEY`), and its weights are ``splitlearn_client*.safetensors``, not
    ``model*.safetensors``: a plain class's ``from_pretrained`` finds no weights (an error) instead
    of initialising the server's blocks at random."""
    d_ = Path(directory)
    index = d_ / "model.safetensors.index.json"
    if index.is_file():  # sharded: the shards renamed, the index rewritten
        idx = json.loads(index.read_text())
        renamed = {f: f.replace("model", CLIENT_FILE_STEM, 1) for f in set(idx.get("weight_map", {}).values())}
        for old, new in renamed.items():
            (d_ / old).replace(d_ / new)
        idx["weight_map"] = {k: renamed[f] for k, f in idx["weight_map"].items()}
        (d_ / f"{CLIENT_FILE_STEM}.safetensors.index.json").write_text(json.dumps(idx, indent=2) + "\n")
        index.unlink()
    elif (d_ / "model.safetensors").is_file():
        (d_ / "model.safetensors").replace(d_ / f"{CLIENT_FILE_STEM}.safetensors")
    path = d_ / "config.json"
    d = json.loads(path.read_text())
    d[SPLIT_KEY] = {"model_type": d.get("model_type", config.model_type), "cuts": list(cuts), "client_only": True,
                    "note": _refusal("This folder")}
    d["model_type"] = SPLIT_MODEL_TYPE
    path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def is_split_folder(source) -> bool:
    """Whether ``source`` is a directory a split model's ``save_pretrained`` wrote."""
    if not isinstance(source, (str, Path)) or not (Path(source) / "config.json").is_file():
        return False
    try:
        return json.loads((Path(source) / "config.json").read_text()).get("model_type") == SPLIT_MODEL_TYPE
    except ValueError:
        return False


def load_split_folder(hf_cls: type, source, seed: int = 0, **config_kwargs):
    """A ``hf_cls`` (the plain class) holding the client's weights of the split folder ``source``;
    the parts the folder lacks (the server's) are freshly initialised, for :func:`split_into
    <splitlearn.hf.sources.split_into>` to drop. Its config keeps the fingerprint of the weights
    the first session loaded, which the server's is compared with."""
    from safetensors.torch import load_file

    d = json.loads((Path(source) / "config.json").read_text())
    family = d.pop(SPLIT_KEY, {}).get("model_type")
    d.pop("model_type", None)
    if not family:
        raise ConfigError(f"{source}/config.json names no model type under {SPLIT_KEY!r}")
    config = AutoConfig.for_model(family, **{**d, **config_kwargs})
    files = sorted(Path(source).glob(f"{CLIENT_FILE_STEM}*.safetensors"))
    if not files:
        raise ConfigError(f"{source} holds no {CLIENT_FILE_STEM}.safetensors (a split model's save_pretrained "
                          f"writes the client's weights there)")
    with _LOAD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf_cls(config)
    state = {}
    for f in files:
        state.update({k: v for k, v in load_file(str(f)).items() if ".remote." not in k and "lora_" not in k})
    state = {k.replace(".base_layer.", "."): v for k, v in state.items()}
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ConfigError(f"{source} holds tensors a {hf_cls.__name__} has not: {result.unexpected_keys[:4]}")
    return model.eval()


# -- the whole model -------------------------------------------------------------------------

def stock_loss_type(hf_cls: type, config) -> Optional[str]:
    """The ``loss_type`` transformers gives ``hf_cls`` (the unsplit class) for ``config``: what
    ``PreTrainedModel.__init__`` sets, read from a shell of the class (no module built)."""
    from transformers import PreTrainedModel

    shell = hf_cls.__new__(hf_cls)
    PreTrainedModel.__init__(shell, copy.deepcopy(config))
    return shell.loss_type


def plain_config(model):
    """The split model's config as the plain model's: splitlearn's keys gone; 2-way, the head untied
    (the server's LM head is its own copy of the embeddings)."""
    config = copy.deepcopy(model.config)
    for key in [k for k in vars(config) if k.startswith("splitlearn")]:
        delattr(config, key)
    if not model.remote.u_shape:  # any split model's segment (GPT-2's classes: their trunk's)
        config.tie_word_embeddings = False
    return config


def fetch_weights(remote) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``GET /v1/clients/<id>/weights``: the server's segment now (Hugging Face names) and this
    client's server-side adapter (peft names), with the answer's metadata."""
    return decode(remote.transport.get_bytes(P.CLIENT_WEIGHTS.format(client_id=remote.client_id)))


def _client_state(model) -> dict[str, torch.Tensor]:
    """The client's weights under the plain model's names (peft's ``base_layer`` folded back)."""
    out = {}
    for k, v in model.state_dict().items():
        if ".remote." in k or "lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v
    return out


def _merge_adapters(unsplit, state: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
                    spec: LoraSpec) -> int:
    """``W += scale * B @ A`` for each adapter pair (peft names) into ``state``; returns the pairs."""
    from transformers.pytorch_utils import Conv1D

    n = 0
    for key in [k for k in adapters if k.endswith(".lora_A.weight")]:
        module = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
        a, b = adapters[key].float(), adapters[key.replace(".lora_A.", ".lora_B.")].float()  # (r, in), (out, r)
        delta = (b @ a) * spec.scale  # (out, in)
        if isinstance(unsplit.get_submodule(module), Conv1D):
            delta = delta.t()  # Conv1D keeps (in, out)
        w = state[f"{module}.weight"]
        state[f"{module}.weight"] = (w.float() + delta.to(w.device)).to(w.dtype)
        n += 1
    return n


def merge_and_unload(model):
    """The family's plain transformers model with this split model's weights: the client's, the
    server's as they are now (its last step applied first), and every LoRA adapter merged. See
    the module docstring. ``ConfigError`` where the server's weights do not cover the model;
    ``Forbidden`` (403) where the server does not export them."""
    from transformers import AutoModelForCausalLM

    from .lora import adapter_tensors

    remote = model.remote
    remote.flush()  # the last optimizer step's apply: the server's weights hold it
    server, meta = fetch_weights(remote)
    config = plain_config(model)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    with _LOAD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if getattr(model, "causal_lm", False) or not hasattr(type(model), "HF_CLASS"):  # any family's Split<Name>
            unsplit = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            unsplit = type(model).HF_CLASS(config).to(dtype)
    state = _client_state(model)
    state.update({k: v for k, v in server.items() if not k.startswith(PEFT_PREFIX)})
    merged = 0
    client_spec = getattr(model, "lora_spec", None)
    if client_spec is not None:
        merged += _merge_adapters(unsplit, state, adapter_tensors(model), client_spec)
    server_adapter = {k: v for k, v in server.items() if k.startswith(PEFT_PREFIX)}
    if server_adapter:
        merged += _merge_adapters(unsplit, state, server_adapter, LoraSpec.from_dict(json.loads(meta["lora"])))
    expected = set(unsplit.state_dict())
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ConfigError(f"the client's and the server's weights do not make a {type(unsplit).__name__}: "
                          f"missing {missing[:4]}, extra {extra[:4]}")
    unsplit.load_state_dict(state, strict=True)
    unsplit.train(model.training)
    # split again against this server (split_model(unsplit, ...)): compared as the model first loaded.
    # Not in its config: a folder it saves is a checkpoint of its own, a new server's fingerprint
    kept = getattr(model.config, "splitlearn_fingerprint", None)
    if kept:
        unsplit._splitlearn_fingerprint = kept
    log.info("merged %d client and %d server tensors (%d LoRA adapters) into a %s", len(state) - len(server),
             len(server) - len(server_adapter), merged, type(unsplit).__name__)
    return unsplit


def export_merged(model, directory, tokenizer=None) -> Path:
    """:func:`merge_and_unload` of ``model`` saved to ``directory`` (``save_pretrained``), with
    ``tokenizer`` beside it where given: a folder ``AutoModelForCausalLM`` / ``AutoTokenizer`` and
    ``pipeline("text-generation", model=directory)`` load as any checkpoint (``train
    --export-merged DIR``, client/finetune_trainer.py). Returns the directory."""
    d = Path(directory)
    merge_and_unload(model).save_pretrained(d)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(d)
    log.info("the whole model (client, server and adapters merged) saved to %s", d)
    return d
