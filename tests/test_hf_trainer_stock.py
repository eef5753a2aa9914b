"""Trainer equals the unsplit model again (issue 51, item 5): ``transformers.Trainer`` with gradient
accumulation logs the same losses and ends at the same weights for the split model as for the
*stock* class loaded from the same folder (``GPT2LMHeadModel.from_pretrained(dir)``, not a model
splitlearn built), against a real server in this process. transformers 5.24's Trainer counts a
step's targets over ``labels[..., 1:]`` only when the model's ``loss_type`` maps to
``ForCausalLMLoss``: the split model takes the stock class's ``loss_type``, whatever it is."""
import pytest
import torch
from torch import nn
from transformers import GPT2LMHeadModel

from splitlearn import load_model
from splitlearn.hf import SplitGPT2LMHeadModel

from serverproc import TOKEN, InprocServerProcess

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.slow

LR = 1e-2


def dataset():
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(8):
        ids = torch.randint(0, 256, (12,), generator=g)
        mask = torch.ones(12, dtype=torch.long)
        if i % 3 == 1:
            mask[-4:] = 0  # right padding: targets differ per row, so the count matters
        rows.append((ids.masked_fill(mask == 0, 256), mask, ids.masked_fill(mask == 0, -100)))
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
def test_trainer_with_accumulation_equals_the_stock_class_from_the_same_folder(cuts, tmp_path):
    folder = tmp_path / "model"
    load_model("tiny").save_pretrained(folder)
    stock = GPT2LMHeadModel.from_pretrained(folder)  # what a user compares with
    with InprocServerProcess(cuts, lr=LR, checkpoint_dir=tmp_path / "ckpt", model=str(folder)) as srv:
        split = SplitGPT2LMHeadModel.from_pretrained(folder, server=srv.url, token=TOKEN, client_id="t")
        assert split.loss_type == stock.loss_type  # None for GPT2LMHeadModel in transformers 5.24
        if len(cuts) == 1:  # 2-way: the server's LM head is its own copy of wte
            stock.config.tie_word_embeddings = False
            stock.lm_head.weight = nn.Parameter(stock.transformer.wte.weight.detach().clone())
        losses = run(split, tmp_path / "split")
        ref = run(stock, tmp_path / "stock")
        assert len(losses) == 2 and losses == pytest.approx(ref, rel=1e-4)
        split.flush()
        want = stock.state_dict()
        for name, w in srv.weights().items():  # the server's blocks stepped as the stock model's
            torch.testing.assert_close(w, want[name], atol=1e-3, rtol=1e-3)
        split.remote.close()
