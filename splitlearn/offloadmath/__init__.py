"""The maths masked offload's client and server share (docs/OFFLOAD.md): :mod:`.field` (fixed point in
two prime fields, joined by the CRT) and :mod:`.layers` (the quantised linear layers, their names and
their wire). The client: :mod:`splitlearn.offload`; the server: ``splitlearn.server.engine.offload``.
Imports nothing else of splitlearn."""
