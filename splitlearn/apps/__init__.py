"""Applications on top of the stack: :mod:`.demo` (``make demo``, ``python -m splitlearn.apps.demo``)
and :mod:`.defensetrain` (defense-aware fine-tuning through the model classes and an in-process
server; ``python -m splitlearn.privacy``)."""
