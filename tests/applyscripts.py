"""Scripts a newcomer writes, run by tests/test_hf_applies.py as processes of their own.

``python -m applyscripts SCENARIO URL OUT CLIENT_ID [STEPS | SERVER_CHECKPOINT_DIR]`` (token: ``$SPLITLEARN_TOKEN``) trains the
tiny model against the server at URL and then simply ends, as a script does: no ``flush()``, no
``close()``. It writes the client's weights to ``OUT/client.safetensors`` and a line of JSON to
stdout. Every step's batch is :func:`batch`; the optimizer is SGD at :data:`LR` (the server's).
Each apply would be sent alone after ``apply_wait_s``; here that is 30 s, so what sends the last
one is what the scenario is about (the interpreter's exit, or the model's collection).
"""
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

LR = 0.1
WAIT = 30.0  # apply_wait_s: the idle flusher never sends the last apply in these scripts
KEPT = []  # what the script holds when it ends, as a script's globals are held until its exit


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(100 + step))


def client_weights(model) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if "remote." not in k}


def model_class(url: str, client_id: str, steps: int, out: Path) -> dict:
    """A plain PyTorch loop over SplitGPT2LMHeadModel."""
    from splitlearn.hf import SplitGPT2LMHeadModel

    model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=url, client_id=client_id, apply_wait_s=WAIT).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    times = []
    for step in range(steps):
        t0 = time.monotonic()
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.monotonic() - t0)
    save_file(client_weights(model), str(out / "client.safetensors"))
    return {"step_s": times, "model": model}


def split_client(url: str, client_id: str, out: Path) -> dict:
    from splitlearn import SplitClient

    client = SplitClient(url, "tiny", optimizer="sgd", lr=LR, device="cpu", client_id=client_id)
    client.model.remote.applier.idle_s = WAIT
    for step in range(3):
        client.train_step(batch(step))
    save_file(client_weights(client.model), str(out / "client.safetensors"))
    return {"client": client}


def trainer(url: str, client_id: str, out: Path, server_dir: str) -> dict:
    """transformers.Trainer, max_steps=2; every example is batch(0)'s first row, so the order the
    Trainer draws them in does not matter. Then the same Trainer on the unsplit model, from the
    same weights (the server's, read from its checkpoint ``server_dir`` first), written to
    ``OUT/unsplit.safetensors``: the reference, whatever the Trainer's loss normalisation."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from splitlearn import load_model
    from splitlearn.model.checkpoint import read_weights
    from splitlearn.hf import SplitGPT2LMHeadModel
    from splitlearn.hf.unsplit import stock_loss_type

    server_before = read_weights(server_dir, "server")
    model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=url, client_id=client_id, apply_wait_s=WAIT)
    row = batch(0)[0]
    data = [{"input_ids": row, "labels": row} for _ in range(4)]

    def train(m, name: str) -> None:
        args = TrainingArguments(output_dir=str(out / name), max_steps=2, per_device_train_batch_size=2,
                                 learning_rate=LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                                 max_grad_norm=0.0, save_strategy="no", report_to=[], use_cpu=True,
                                 disable_tqdm=True, logging_strategy="no")
        Trainer(model=m, args=args, train_dataset=data, data_collator=default_data_collator).train()

    train(model, "split")
    save_file(client_weights(model), str(out / "client.safetensors"))
    full = load_model("tiny")
    # the stock class's loss naming (GPT2LMHeadModel names none; load_model names ForCausalLM),
    # as the split model takes it: Trainer counts tokens by it (issue 51, item 5)
    full.loss_type = stock_loss_type(type(full), full.config)
    full.load_state_dict(server_before, strict=False)
    train(full, "unsplit")
    save_file({k: v.detach().clone().contiguous() for k, v in full.state_dict().items()}, str(out / "unsplit.safetensors"))
    return {"model": model}


def abandon(url: str, client_id: str, out: Path) -> None:
    """A forward with gradients on, then the process dies before its backward (no exit handler runs)."""
    from splitlearn.hf import SplitGPT2LMHeadModel

    model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=url, client_id=client_id).train()
    ids = batch(0)
    model(input_ids=ids, labels=ids)
    print(json.dumps({"abandoned": model.remote.step}), flush=True)
    os._exit(0)


def dropped(url: str, client_id: str, out: Path) -> None:
    """Two steps, then the model is dropped and collected; the process dies without exit handlers:
    only the model's finalizer can have sent the last apply (from a thread of its own, which
    exit would join: joined here, as os._exit runs no exit handler)."""
    from splitlearn.hf.applies import wait_dropped

    kept = model_class(url, client_id, 2, out)
    del kept["model"]
    gc.collect()
    wait_dropped()
    print(json.dumps({"dropped": True}), flush=True)
    os._exit(0)


def main(argv) -> None:
    scenario, url, out, client_id = argv[:4]
    out = Path(out)
    if scenario == "model":
        KEPT.append(model_class(url, client_id, int(argv[4]) if len(argv) > 4 else 3, out))
        print(json.dumps({"step_s": KEPT[0]["step_s"]}), flush=True)
    elif scenario == "client":
        KEPT.append(split_client(url, client_id, out))
    elif scenario == "trainer":
        KEPT.append(trainer(url, client_id, out, argv[4]))
    else:
        {"abandon": abandon, "dropped": dropped}[scenario](url, client_id, out)


if __name__ == "__main__":
    # python -m keeps __main__ (and KEPT) alive until after the exit handlers; so does this name
    # when the tests fork the script from a preloaded interpreter (runpy drops its own reference)
    sys.modules["applyscripts_main"] = sys.modules[__name__]
    main(sys.argv[1:])
