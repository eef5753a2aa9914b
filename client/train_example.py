"""Train a split GPT-2 against a running splitlearn server, then generate from it.

    export SPLITLEARN_TOKEN=...
    python -m splitlearn.server --model tiny-demo --cut 2 --cut 4 &
    python client/train_example.py --server http://127.0.0.1:8000
"""
import argparse

import torch

from splitlearn import ByteTokenizer, load_corpus
from splitlearn.client import SplitClient
from splitlearn.model.data import lm_batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="tiny-demo")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=60)
    a = p.parse_args()
    tok = ByteTokenizer()
    batches = lm_batches(tok.encode(load_corpus()), batch_size=16, seq_len=64)
    with SplitClient(a.server, a.model, lr=5e-3) as client:
        for step in range(1, a.steps + 1):
            loss = client.train_step(next(batches))
            if step % 20 == 0:
                print(f"step {step}: loss {loss:.3f}")
        prompt = torch.tensor([tok.encode("Once upon a time")])
        out = client.generate(prompt, max_new_tokens=a.max_new_tokens, do_sample=True, temperature=0.8, top_k=20, seed=0)
        print(tok.decode(out[0].tolist()))
        print(client.stats.as_dict())


if __name__ == "__main__":
    main()
