"""Sequence classification with a split GPT-2 and a plain PyTorch training loop.

``SplitGPT2ForSequenceClassification`` is transformers' ``GPT2ForSequenceClassification`` whose
middle blocks run on a U-shape splitlearn server (it holds only the trunk: the classification
head, the labels and the loss stay here). ``loss.backward()`` sends the gradient through the
server's blocks; ``optimizer.step()`` steps both sides, with this optimizer's learning rate.

The task, made up below so that the example needs no download: is a sentence a question, an
exclamation or a statement?

    export SPLITLEARN_TOKEN=...                                  # or --token / --token-file
    python -m splitlearn.server --model tiny-demo --cut 2 --cut 4 &
    python client/classify.py --server http://127.0.0.1:8000 --model tiny-demo --steps 100
"""
import argparse
import os
import random

import torch

from splitlearn import SplitGPT2ForSequenceClassification, get_tokenizer
from splitlearn.api.protocol import parse_token_line, read_token_file

LABELS = ("statement", "question", "exclamation")
SUBJECTS = ("the cat", "my friend", "the old man", "a small dog", "the teacher", "her brother", "the bird",
            "our neighbour", "the little girl", "a tall tree")
VERBS = ("sits by the door", "likes the rain", "walks to school", "sings in the morning", "reads a book",
         "eats an apple", "sleeps all day", "plays in the park", "looks at the sky", "waits for the bus")


def make_dataset(n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` (sentence, label) pairs: a statement ends with '.', a question is 'does X ...?',
    an exclamation ends with '!'."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s, v, label = rng.choice(SUBJECTS), rng.choice(VERBS), rng.randrange(len(LABELS))
        if label == 0:
            text = f"{s.capitalize()} {v}."
        elif label == 1:
            text = f"Does {s} {v.split()[0].rstrip('s')} {' '.join(v.split()[1:])}?"
        else:
            text = f"Look, {s} {v}!"
        out.append((text, label))
    return out


def encode(tok, text: str) -> list[int]:
    return tok.encode(text) if not callable(getattr(tok, "convert_ids_to_tokens", None)) \
        else tok(text, add_special_tokens=False)["input_ids"]


def collate(tok, rows: list[tuple[str, int]]) -> dict:
    """Right-padded input_ids and attention_mask, and labels (the head reads the last real token)."""
    seqs = [encode(tok, t) for t, _ in rows]
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([y for _, y in rows])}


@torch.no_grad()
def accuracy(model, tok, rows, batch_size: int) -> float:
    model.eval()
    right = 0
    for i in range(0, len(rows), batch_size):
        batch = collate(tok, rows[i:i + batch_size])
        pred = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
        right += int((pred == batch["labels"]).sum())
    return right / len(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default="http://127.0.0.1:8000", help="a U-shape splitlearn server's URL")
    p.add_argument("--token", help="bearer token (default: $SPLITLEARN_TOKEN)")
    p.add_argument("--token-file", help="file whose first line is the bearer token")
    p.add_argument("--client-id", help="this data owner's name on the server (default: random)")
    p.add_argument("--model", default="tiny-demo", help="the server's model source")
    p.add_argument("--seed", type=int, default=0, help="seed of a spec's random init and of the data")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-size", type=int, default=400)
    p.add_argument("--test-size", type=int, default=96)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    token = parse_token_line(read_token_file(args.token_file)[0])[1] if args.token_file else \
        args.token or os.environ.get("SPLITLEARN_TOKEN")
    tok = get_tokenizer(args.model)
    train, test = make_dataset(args.train_size, args.seed), make_dataset(args.test_size, args.seed + 1)
    model = SplitGPT2ForSequenceClassification.from_pretrained(
        args.model, server=args.server, token=token, client_id=args.client_id, seed=args.seed,
        num_labels=len(LABELS), pad_token_id=tok.pad_token_id)
    try:
        before = accuracy(model, tok, test, args.batch_size)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / args.steps)  # reaches the server too
        rng = random.Random(args.seed)
        losses = []
        model.train()
        for step in range(1, args.steps + 1):
            batch = collate(tok, rng.sample(train, args.batch_size))
            loss = model(**batch).loss
            loss.backward()  # the gradient crosses to the server's blocks
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm, both sides
            opt.step()  # steps the server's blocks too
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
            if step % max(1, args.steps // 10) == 0 or step == args.steps:
                print(f"step {step}: loss {loss.item():.4f}")
        after = accuracy(model, tok, test, args.batch_size)
        print(f"test accuracy: {before:.3f} before, {after:.3f} after {args.steps} steps "
              f"({model.remote.applies} server steps, {model.remote.stats.calls} calls)")
        return {"losses": losses, "accuracy_before": before, "accuracy_after": after,
                "server_applies": model.remote.applies}
    finally:
        model.remote.close()


if __name__ == "__main__":
    main()
