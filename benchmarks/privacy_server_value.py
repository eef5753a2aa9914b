"""What the server's update is worth, per U-shape row of ``python -m splitlearn.privacy --json`` files
(docs/PRIVACY.md, 'What the server still contributes'): for each row, the model it measured (the
reference, or its defense-fine-tuned copy read from the cache, never retrained) on the same private
windows, three perplexities, the row's defense in place:

- ``with``: the split model as the meter scores it (its ``perplexity``; recomputed as a check);
- ``without``: the client's blocks alone, the server's update taken as zero (``perplexity_without_server``);
- ``mean_update``: each window's server update replaced by the mean, per position, of its updates
  for the other private windows (:func:`splitlearn.privacy.meter.perplexity_mean_update`): the
  update keeps what does not depend on the text and loses what does.

``without - with`` is what the server's update is worth; ``mean_update - with`` is what its
*text-dependent* part is worth (a client that learned a fixed offset from the server scores
``mean_update`` ~ ``with`` and ``without`` >> ``with``).

    python -m benchmarks.privacy_server_value docs/privacy/gpt2-small-u2.json ... --json OUT.json

Run from the repository root; reads the fine-tunings from the privacy cache (``$SPLITLEARN_CACHE``,
default ``~/.cache/splitlearn/privacy``) and fails on a row whose fine-tuning is not cached."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv=None) -> int:
    from splitlearn.model.data import ByteTokenizer
    from splitlearn.apps.defensetrain import finetune_defense
    from splitlearn.model.loading import load_model
    from splitlearn.defense.defenses import make_defense
    from splitlearn.privacy.meter import (perplexities, perplexity_mean_update,
                                          perplexity_without_server, private_windows)
    from splitlearn.privacy.reference import train_reference

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = []
    for f in args.files:
        data = json.loads(Path(f).read_text())
        tr = data.get("trained")
        if not tr:
            raise SystemExit(f"{f}: not a --train-steps run (its reference is not cached by name)")
        ref = train_reference(tr["source"], steps=tr["steps"], seed=tr["seed"], progress=False)  # cached
        tok = ByteTokenizer()
        for r in data["rows"]:
            if len(r["cut"]) != 2 or r.get("attacker_knows", "finetuned") != "finetuned":
                continue
            cut = tuple(r["cut"])
            d = dict(r["defense"])
            defense = None if d["name"] == "none" else make_defense(d.pop("name"), **d)
            info = r.get("finetune")
            if info:
                path = finetune_defense(info["source"], cut, defense or make_defense("none"), info["steps"],
                                        batch_size=info["batch_size"], seq_len=info["seq_len"],
                                        lr=info["lr"], seed=info["seed"], progress=False)
                if not (Path(path) / "finetune.json").is_file():
                    raise SystemExit(f"{f}: the fine-tuning of {r['defense']} is not cached")
            else:
                path = ref
            model = load_model(str(path), seed=0).eval()
            ids = private_windows(tok, seq_len=r["seq_len"], max_private_tokens=r["private_tokens"])
            with_server = perplexities(model, cut, ids, defense, 0)[0]
            row = {"file": f, "cut": list(cut), "defense": r["defense"], "preset": r.get("preset"),
                   "finetune_steps": r.get("finetune_steps") or 0, "token_recovery": r["token_recovery"],
                   "best_attack": r["best_attack"], "perplexity_undefended": r.get("perplexity_undefended"),
                   "perplexity_row": r["perplexity"], "with": with_server,
                   "without": perplexity_without_server(model, cut, ids),
                   "mean_update": perplexity_mean_update(model, cut, ids, defense, 0)}
            out.append(row)
            print(f"{f} U {cut} {r['defense']} ft {row['finetune_steps']}: recovery {row['token_recovery']:.3f} "
                  f"({row['best_attack']}), with {row['with']:.2f} (row {row['perplexity_row']:.2f}), "
                  f"without {row['without']:.2f}, server's update averaged {row['mean_update']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
