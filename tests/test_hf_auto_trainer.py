"""``transformers.Trainer`` on the other families' split client (``AutoSplitModelForCausalLM``,
docs/MODELS.md): a tiny Llama (GQA) and Gemma 2, U-shape and 2-way, with gradient accumulation
(2 pieces a step), a linear schedule and the clip across both sides, log the same losses and end
at the same weights on both sides as the *stock* class loaded from the same folder
(``AutoModelForCausalLM.from_pretrained(dir)``) against an in-process server. The split model
keeps the family's ``loss_type``, so Trainer counts a step's targets as for the stock class; a
2-way loss (the server's mean over its batch) is rescaled by ``num_items_in_batch`` as the
family's loss is (without it the second piece's loss would weigh as much as the first)."""
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn import AutoSplitModelForCausalLM

from serverproc import TOKEN, InprocServerProcess

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.slow

LR = 1e-2


def dataset():
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(8):
        ids = torch.randint(3, fam.V, (12,), generator=g)
        mask = torch.ones(12, dtype=torch.long)
        if i % 3 == 1:
            mask[-4:] = 0  # right padding: targets differ per row, so the count matters
        rows.append((ids.masked_fill(mask == 0, fam.PAD), mask, ids.masked_fill(mask == 0, -100)))
    return datasets.Dataset.from_dict({"input_ids": [r[0].tolist() for r in rows],
                                       "attention_mask": [r[1].tolist() for r in rows],
                                       "labels": [r[2].tolist() for r in rows]})


def run(model, out):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=2, learning_rate=LR, lr_scheduler_type="linear", logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                             dataloader_num_workers=0, max_grad_norm=1.0, weight_decay=0.0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), optimizers=(opt, None))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
@pytest.mark.parametrize("name", ["llama-gqa", "gemma2"])
def test_trainer_with_accumulation_equals_the_stock_class_from_the_same_folder(name, cuts, tmp_path):
    folder = tmp_path / "model"
    fam.model(name).save_pretrained(folder)
    stock = AutoModelForCausalLM.from_pretrained(folder)  # what a user compares with
    with InprocServerProcess(cuts, lr=LR, checkpoint_dir=tmp_path / "ckpt", model=str(folder)) as srv:
        split = AutoSplitModelForCausalLM.from_pretrained(str(folder), server=srv.url, token=TOKEN, client_id="t")
        assert isinstance(split, type(stock)) and split.loss_type == stock.loss_type
        if len(cuts) == 1 and stock.config.tie_word_embeddings:  # 2-way: the server's head is its own copy
            stock.config.tie_word_embeddings = False
            stock.lm_head.weight = nn.Parameter(stock.get_input_embeddings().weight.detach().clone())
        losses = run(split, tmp_path / "split")
        ref = run(stock, tmp_path / "stock")
        assert len(losses) == 2 and losses == pytest.approx(ref, rel=1e-5)
        split.remote.flush()
        want = stock.state_dict()
        server = srv.weights()
        assert server and not set(server) & set(split.state_dict())  # the server's layers are its own
        for n, w in {**server, **split.state_dict()}.items():  # every weight stepped as the stock model's
            if "remote." not in n:
                torch.testing.assert_close(w, want[n], atol=1e-5, rtol=1e-5, msg=n)
        split.remote.close()
