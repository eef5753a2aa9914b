"""What client and server say to each other, and what a client accepts of it.

- :mod:`.wire` (the wire format: safetensors bodies, never pickle), :mod:`.protocol` (routes,
  message fields, the protocol version), :mod:`.openapi` (the API as an OpenAPI document, built
  from :mod:`.protocol`);
- :mod:`.trust` (the split a client pins, the checks of every answer's tensors),
  :mod:`.fingerprint` (a digest of tensors made where they lie: the request log and the ledger).

Imports only :mod:`splitlearn.errors`; docs/PROTOCOL.md is the protocol, docs/ARCHITECTURE.md the
layers."""
