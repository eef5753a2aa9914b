"""The ledger's digests are in the memory account (issue 50, item 10; splitlearn/server/engine/ledger.py).

After an apply the ledger keeps a 16-byte digest of every piece's and forward's answer (so a
retried piece gets 409, never a second application): up to 2 x 4096 a client, 64 clients a
tenant. They were outside the account. The attack: a tenant's clients apply steps of many
pieces, and the digests pile up beside what the account lets the tenant hold. Now each costs
``DIGEST_BYTES`` of the tenant's share while kept, what they really take is at most that
(measured here with tracemalloc), and they are given back at the client's next step or when
the client is forgotten.
"""
import tracemalloc

import pytest
import torch

from splitlearn.errors import TooManyRequests
from splitlearn.server.engine.ledger import DIGEST_BYTES, Answer, StepLedger
from splitlearn.server.engine.memory import MemoryAccount

MiB = 1 << 20


def answer(k: int) -> Answer:
    return Answer({"y": torch.full((2,), float(k))})


def apply_step(ledger: StepLedger, client: str, step: int, pieces: int) -> None:
    ps = {i: answer(i) for i in range(pieces)}
    fs = {i: answer(-i) for i in range(pieces)}
    ledger.applied(client, step, Answer({}, {"applied": "1"}), ps, fs)


def test_a_tenants_digests_count_against_its_share():
    account = MemoryAccount(64 * MiB, 3 * MiB)
    ledger = StepLedger(account=account)
    for c in range(3):  # the attack: mallory's clients apply steps of many pieces
        apply_step(ledger, f"mallory:c{c}", 1, 2048)
    digests = 3 * 2 * 2048 * DIGEST_BYTES  # 3 MiB: her whole share
    assert account.tenants["mallory"] >= digests
    with pytest.raises(TooManyRequests):  # her next body or graph does not fit beside them
        account.reserve("mallory", 64 << 10, "a request body")
    account.release(account.reserve("alice", 1 * MiB, "a request body"))  # another tenant's share is untouched
    apply_step(ledger, "mallory:c0", 2, 1)  # a client's next step gives its last step's digests back
    assert account.tenants["mallory"] < digests - 2 * 2048 * DIGEST_BYTES + 4 * DIGEST_BYTES + (1 << 16)
    for c in range(3):
        ledger.forget(f"mallory:c{c}")
    assert account.tenants.get("mallory", 0) == 0 and account.reserved == 0


def test_digests_past_the_share_are_counted_not_lost():
    """The step is applied already when its digests are made: they are counted even past the
    share (never refused, never dropped: exactly-once needs them), and the tenant's next
    reservations wait until they go."""
    account = MemoryAccount(64 * MiB, 1 * MiB)
    ledger = StepLedger(account=account)
    apply_step(ledger, "mallory:a", 1, 4096)  # 2 MiB of digests
    assert account.tenants["mallory"] >= 2 * 4096 * DIGEST_BYTES > account.tenant_limit
    assert ledger.clients["mallory:a"].pieces[4095].digest is not None  # a retry of it still gets 409
    with pytest.raises(TooManyRequests):
        account.reserve("mallory", 1, "a request body")


def test_the_reserved_bytes_cover_what_the_digests_take():
    ledger = StepLedger(account=MemoryAccount(1 << 40, 1 << 40))
    pieces = 4096
    ps = {i: answer(i) for i in range(pieces)}
    fs = {i: answer(-i) for i in range(pieces)}
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ledger.applied("alice:x", 1, Answer({}, {"applied": "1"}), ps, fs)
        del ps, fs  # the answers themselves go once the step is applied: only the digests stay
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    held = ledger.clients["alice:x"].digests_hold.nbytes
    assert held == 2 * pieces * DIGEST_BYTES
    assert 0 < taken <= held, (taken / (2 * pieces), DIGEST_BYTES)


def test_a_resumed_ledger_reserves_its_digests():
    account = MemoryAccount(64 * MiB, 64 * MiB)
    ledger = StepLedger(account=account)
    apply_step(ledger, "alice:x", 1, 100)
    counters = ledger.to_counters()
    resumed = StepLedger.from_counters(counters)
    fresh = MemoryAccount(64 * MiB, 64 * MiB)
    resumed.account = fresh
    resumed.hold_all()
    assert fresh.tenants["alice"] >= 200 * DIGEST_BYTES
