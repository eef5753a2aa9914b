"""The model's maths, the same on both sides of the cut: no process, no network.

- :mod:`.partition` (cut a GPT-2 at block boundaries), :mod:`.segments` (a segment and the blocks it
  runs), :mod:`.loading` (``load_model``: a GPT-2 from a spec, a directory or the hub),
  :mod:`.specs` (the shipped specs, torch-free), :mod:`.export` (segments to disk and back),
  :mod:`.devices` (device and dtype names);
- :mod:`.headloss` (the LM loss in chunks of positions), :mod:`.packed` (few-row inference on
  prepacked weights), :mod:`.lora` (LoRA specs, adapters, the router of many adapters);
- :mod:`.checkpoint` (a side's training state, saved atomically);
- :mod:`.data`, :mod:`.tokenizer` (offline tokenizers, the shipped corpus in ``corpus/``, batches).

Imports only :mod:`splitlearn.errors`; docs/ARCHITECTURE.md draws the layers."""
