"""Fine-tune a split GPT-2 with transformers.Trainer on a local text file, read through datasets.

The model is an ordinary transformers model whose server-side blocks run on a splitlearn server:
Trainer's AdamW, linear schedule, gradient accumulation and gradient clipping (the global norm
over both sides) reach the server's blocks through the wire. Then it generates with
transformers' own generate().

    pip install 'splitlearn[train]'
    export SPLITLEARN_TOKEN=...                                  # or --token / --token-file
    python -m splitlearn.server --model tiny-demo --cut 2 --cut 4 &
    python client/finetune_trainer.py --server http://127.0.0.1:8000 --model tiny-demo \\
        --text-file my_corpus.txt --max-steps 200 --output-dir finetune-out

--model must be the server's model source (the same spec name and --seed, hub id or checkpoint).
At the end the whole trained model is saved to OUTPUT_DIR/model (the server must allow it:
--allow-weight-export, the default for a server with one tenant).
"""
import argparse
import json
import math
import os

import torch

from splitlearn import SplitGPT2LMHeadModel, get_tokenizer
from splitlearn.hf.unsplit import export_merged
from splitlearn.model.data import CORPUS
from splitlearn.api.protocol import parse_token_line, read_token_file


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default="http://127.0.0.1:8000", help="the splitlearn server's URL")
    p.add_argument("--token", help="bearer token (default: $SPLITLEARN_TOKEN)")
    p.add_argument("--token-file", help="file whose first line is the bearer token")
    p.add_argument("--client-id", help="this data owner's name on the server (default: random)")
    p.add_argument("--model", default="tiny-demo", help="model source, the same as the server's: spec name, "
                                                        "hub id or local checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of a spec's random init (the server's --seed)")
    p.add_argument("--text-file", default=str(CORPUS), help="plain text, one example per line (default: the "
                                                            "corpus shipped with splitlearn)")
    p.add_argument("--eval-file", help="held-out plain text for Trainer's evaluation (default: the last "
                                       "--eval-fraction of --text-file's blocks, not trained on)")
    p.add_argument("--eval-fraction", type=float, default=0.1, help="the share of the blocks held out when no "
                                                                    "--eval-file is given (0: no evaluation)")
    p.add_argument("--eval-steps", type=int, help="evaluate every N optimizer steps (default: max-steps / 4)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per training example")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--wire-dtype", default="float32", choices=["float32", "bfloat16", "float16", "int8"])
    p.add_argument("--output-dir", default="finetune-out", help="Trainer's output directory (logs, losses)")
    p.add_argument("--prompt", default="Once upon a time", help="generated from after training")
    p.add_argument("--max-new-tokens", type=int, default=40)
    return p.parse_args(argv)


def token_of(args) -> str | None:
    if args.token_file:
        return parse_token_line(read_token_file(args.token_file)[0])[1]
    return args.token or os.environ.get("SPLITLEARN_TOKEN")


def encode(tok, text: str) -> list[int]:
    """Token ids of ``text`` (splitlearn's ByteTokenizer or a Hugging Face tokenizer)."""
    return tok.encode(text) if not callable(getattr(tok, "convert_ids_to_tokens", None)) \
        else tok(text, add_special_tokens=False)["input_ids"]


def lm_dataset(text_file: str, tok, seq_len: int, cache_dir: str):
    """The text file as a ``datasets.Dataset`` of ``seq_len``-token blocks (run_clm's grouping:
    lines tokenized with an end-of-text token, concatenated, cut into blocks; labels = inputs)."""
    from datasets import load_dataset

    raw = load_dataset("text", data_files={"train": text_file}, split="train", cache_dir=cache_dir)
    eos = tok.eos_token_id

    def tokenize(batch):
        return {"ids": [encode(tok, line) + [eos] for line in batch["text"] if line.strip()]}

    def group(batch):
        flat = [t for ids in batch["ids"] for t in ids]
        n = len(flat) // seq_len * seq_len
        blocks = [flat[i:i + seq_len] for i in range(0, n, seq_len)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    ds = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    ds = ds.map(group, batched=True, batch_size=1000, remove_columns=ds.column_names)
    if len(ds) == 0:
        raise SystemExit(f"{text_file} holds fewer than {seq_len} tokens")
    return ds


def main(argv=None) -> dict:
    args = parse_args(argv)
    from splitlearn._extras import require

    require("train", "datasets", "accelerate", what="fine-tuning with transformers.Trainer")
    from transformers import Trainer, TrainingArguments, default_data_collator

    tok = get_tokenizer(args.model)
    os.makedirs(args.output_dir, exist_ok=True)
    cache = os.path.join(args.output_dir, "datasets-cache")
    ds = lm_dataset(args.text_file, tok, args.seq_len, cache)
    if args.eval_file:  # the held-out split: its own file, or the last blocks of the training text
        held_out = lm_dataset(args.eval_file, tok, args.seq_len, cache)
    elif args.eval_fraction > 0 and len(ds) > 1:
        n = max(1, int(len(ds) * args.eval_fraction))
        ds, held_out = ds.select(range(len(ds) - n)), ds.select(range(len(ds) - n, len(ds)))
    else:
        held_out = None
    model = SplitGPT2LMHeadModel.from_pretrained(args.model, server=args.server, token=token_of(args),
                                                 client_id=args.client_id, wire_dtype=args.wire_dtype,
                                                 seed=args.seed)
    print(f"{len(ds)} examples of {args.seq_len} tokens; {model.remote}")
    try:
        training = TrainingArguments(
            output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, lr_scheduler_type="linear",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=max(1, args.max_steps // 20),
            save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=args.seed,
            dataloader_num_workers=0, disable_tqdm=True,
            eval_strategy="steps" if held_out is not None else "no",
            eval_steps=args.eval_steps or max(1, args.max_steps // 4), per_device_eval_batch_size=args.batch_size)
        trainer = Trainer(model=model, args=training, train_dataset=ds, eval_dataset=held_out,
                          data_collator=default_data_collator)
        result = trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"trained {result.global_step} steps; logged losses {[round(x, 4) for x in losses]}")
        evals = [{"step": h["step"], "loss": h["eval_loss"], "perplexity": math.exp(min(h["eval_loss"], 700.0))}
                 for h in trainer.state.log_history if "eval_loss" in h]
        if held_out is not None:
            final = trainer.evaluate()  # the trained model on the held-out split
            evals.append({"step": result.global_step, "loss": final["eval_loss"],
                          "perplexity": math.exp(min(final["eval_loss"], 700.0))})
            print(f"held-out ({len(held_out)} examples): loss {evals[-1]['loss']:.4f}, "
                  f"perplexity {evals[-1]['perplexity']:.2f}")
        model.eval()
        prompt = torch.tensor([encode(tok, args.prompt)])
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=args.max_new_tokens, do_sample=True, top_k=20, temperature=0.8,
                             pad_token_id=tok.eos_token_id)
        text = tok.decode(out[0].tolist(), skip_special_tokens=True)
        print(text)
        summary = {"steps": result.global_step, "losses": losses, "evals": evals, "server_applies": model.remote.applies,
                   "sample": text, "wire": model.remote.stats.as_dict()}
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        # the whole trained model (the server's weights too): AutoModelForCausalLM.from_pretrained(DIR)
        summary["model"] = str(export_merged(model, os.path.join(args.output_dir, "model"), tok))
        print(f"the whole model: {summary['model']} (AutoModelForCausalLM.from_pretrained)")
        return summary
    finally:
        model.remote.close()


if __name__ == "__main__":
    main()
