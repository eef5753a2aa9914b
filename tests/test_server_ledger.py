"""The exactly-once step record: replay, expect-next, pending forwards, checkpoint counters."""
import pytest
import torch

from splitlearn.errors import Conflict, TooManyRequests
from splitlearn.server.engine.ledger import APPLIED, CHECKPOINT_ANSWER_BYTES, DIGEST_BYTES, Answer, Pending, StepLedger, digest_of
from splitlearn.server.engine.memory import MemoryAccount


def answer(x: float) -> Answer:
    """An apply's answer (the ledger keeps whatever it holds: here a tensor too)."""
    return Answer({"grad": torch.full((2, 3), x)}, {"step": str(int(x)), APPLIED: "1"})


def test_next_step_passes_and_others_conflict():
    led = StepLedger()
    led.expect_next("a", 1)
    for wrong in (0, 2, 5):
        with pytest.raises(Conflict, match="applied step 0, so the next is 1"):
            led.expect_next("a", wrong)
    led.applied("a", 1, answer(1))
    led.expect_next("a", 2)
    with pytest.raises(Conflict):
        led.expect_next("a", 1)
    led.expect_next("b", 1)  # clients are independent
    assert led.last_step("a") == 1 and led.last_step("b") == 0 and led.steps_applied == 1


def test_replay_gives_the_stored_answer_of_the_last_step_only():
    led = StepLedger()
    assert led.replay_apply("a", 1) is None
    first = answer(1)
    led.applied("a", 1, first)
    assert led.replay_apply("a", 1).encode() == first.encode()  # kept as its bytes: byte for byte the first
    assert led.replay("a", 1) is None  # not a piece of it: the caller's 409
    led.applied("a", 2, answer(2))
    assert led.replay_apply("a", 1) is None  # an older step is not replayable: 409 from expect_next
    assert led.replay_apply("a", 2).meta == {"step": "2", APPLIED: "1"}


def test_pending_forward_is_kept_per_step_and_cleared_when_applied():
    led = StepLedger()
    p = Pending(1, state=("inputs", "outputs"))
    led.set_pending("a", p)
    assert led.pending("a") is p and led.pending("a", 1) is p
    assert led.pending("a", 2) is None and led.pending("b") is None
    led.applied("a", 1, answer(1))
    assert led.pending("a") is None


def test_counters_round_trip_with_byte_identical_answers():
    led = StepLedger()
    led.applied("a", 1, answer(1))
    led.applied("a", 2, answer(2))
    led.applied("b", 1, answer(7))
    led.set_pending("c", Pending(1, None))  # a pending forward is not checkpointed
    counters = led.to_counters()
    back = StepLedger.from_counters(counters)
    assert back.steps_applied == 3
    assert {c: r.step for c, r in back.clients.items()} == {"a": 2, "b": 1, "c": 0}
    assert back.replay_apply("a", 2).encode() == led.replay_apply("a", 2).encode()
    assert torch.equal(back.replay_apply("b", 1).tensors["grad"], torch.full((2, 3), 7.0))
    assert back.pending("c") is None and back.replay_apply("c", 0) is None


def test_a_closed_step_in_an_older_checkpoint_keeps_its_number_only():
    closed = Answer({"grad": torch.ones(2, 3)}, {"step": "4"})  # no "applied": a closed step's last piece
    import base64
    counters = {"clients": {"a": 4}, "answers": {"a": base64.b64encode(closed.encode()).decode()},
                "pieces": {"a": {"0": base64.b64encode(closed.encode()).decode()}}, "steps_applied": 4}
    back = StepLedger.from_counters(counters)
    assert back.last_step("a") == 4 and back.replay_apply("a", 4) is None and back.replay("a", 4) is None


def big(x: float, n: int = 1 << 16) -> Answer:
    return Answer({"grad": torch.full((n,), float(x))}, {"step": str(int(x)), APPLIED: "1"})  # 256 KiB


def apply_answer(step: int) -> Answer:
    return Answer({}, {"step": str(step), APPLIED: "1"})


def test_an_open_ended_steps_pieces_are_kept_as_digests_and_a_retry_is_409_never_applied_twice():
    """The attack: 300 pieces, then an apply; the ledger kept every piece's answer (tensors and
    bytes) after it. Now it keeps their digests: a retried piece of the applied step is
    recognised (409 naming the digest), a piece the step never had is out of order, and the
    apply's retry still gets its answer."""
    led = StepLedger(account=MemoryAccount(64 << 20, 64 << 20))
    pieces = {i: big(i) for i in range(8)}
    bodies = {i: a.encode() for i, a in pieces.items()}
    led.applied("t:a", 1, apply_answer(1), pieces, {i: big(-i) for i in range(8)})
    rec = led.clients["t:a"]
    assert all(k.body is None for k in rec.kept()[1:]) and rec.answer.body is not None
    assert led.account.reserved == len(rec.answer.body) + 16 * DIGEST_BYTES  # the apply's answer; digests
    with pytest.raises(Conflict, match=f"piece 3 of step 1 was applied.*{digest_of(bodies[3]).hex()}"):
        led.replay("t:a", 1, 3)
    with pytest.raises(Conflict, match="the forward of piece 2 of step 1 was applied"):
        led.replay_forward("t:a", 1, 2)
    assert led.replay("t:a", 1, 99) is None  # not a piece of that step: the caller's 409 (out of order)
    assert led.replay_apply("t:a", 1).meta[APPLIED] == "1"
    assert led.last_step("t:a") == 1 and led.steps_applied == 1
    counters = led.to_counters()  # the checkpoint carries digests, not the pieces' bytes
    assert "pieces" not in counters and len(counters["digests"]["t:a"]["pieces"]) == 8
    back = StepLedger.from_counters(counters)
    with pytest.raises(Conflict, match=digest_of(bodies[3]).hex()):
        back.replay("t:a", 1, 3)
    assert back.replay_apply("t:a", 1).encode() == led.replay_apply("t:a", 1).encode()


def test_the_applies_answers_are_kept_reserved_and_evicted_to_digests_when_room_is_needed():
    account = MemoryAccount(4 << 20, 4 << 20)
    led = StepLedger(account=account)
    for i, c in enumerate("abc"):  # 1 MiB each; the pieces' and forwards' answers: digests
        led.applied(f"t:{c}", 1, big(i, 1 << 18), {0: big(10 + i)}, {0: big(20 + i)})
    kept = lambda: [led.clients[f"t:{c}"].answer for c in "abc"]  # noqa: E731
    assert account.reserved == sum(len(k.body) for k in kept()) + 6 * DIGEST_BYTES  # the applies' bytes; digests
    assert torch.equal(led.replay_apply("t:b", 1).tensors["grad"], big(1, 1 << 18).tensors["grad"])
    # another reservation needs the room: the oldest stored answers go (digests stay)
    hold = account.reserve("t", 2 << 20, "a waiting graph")
    assert account.evictions > 0 and account.reserved <= account.limit
    evicted = [c for c, k in zip("abc", kept()) if k.body is None]
    assert evicted and evicted[0] == "a" and kept()[-1].body is not None  # the newest goes last
    with pytest.raises(Conflict, match="no longer held"):
        led.replay_apply("t:a", 1)
    hold.release()
    led.applied("t:c", 2, big(5))  # the next step gives the last one's memory back
    assert account.reserved == sum(len(k.body) for k in kept() if k.body is not None) + 4 * DIGEST_BYTES  # a's, b's
    for c in "abc":
        led.forget(f"t:{c}")
    assert account.reserved == 0 and account.tenants == {}


def test_the_checkpoint_carries_a_bounded_number_of_answer_bytes():
    led = StepLedger()
    led.applied("t:a", 1, big(9, 1 << 19), {i: big(i) for i in range(16)})  # 2 MiB: over the bound
    led.applied("t:b", 1, big(8))  # 256 KiB
    counters = led.to_counters()
    import json
    text = json.dumps(counters)
    assert len(text) < 4 / 3 * CHECKPOINT_ANSWER_BYTES + 64 * 1024
    back = StepLedger.from_counters(counters)
    assert back.replay_apply("t:b", 1).encode() == led.replay_apply("t:b", 1).encode()  # bytes
    with pytest.raises(Conflict, match="no longer held"):
        back.replay_apply("t:a", 1)  # past the bound: a digest, a clear 409
    with pytest.raises(Conflict, match="was applied"):
        back.replay("t:a", 1, 15)  # its pieces: digests


def test_a_full_account_refuses_with_429_and_the_tenant_share_is_separate_from_the_total():
    account = MemoryAccount(10 << 20, 4 << 20)
    a = account.reserve("alice", 3 << 20, "a graph")
    with pytest.raises(TooManyRequests, match="share of 0.004 GiB"):
        account.reserve("alice", 2 << 20, "another graph")
    b = account.reserve("bob", 4 << 20, "a graph")
    account.reserve("", 2 << 20, "a request's price", shared=False)
    from splitlearn.errors import ServiceUnavailable
    with pytest.raises(ServiceUnavailable, match="the server holds 0.009 GiB of its 0.010 GiB"):
        account.reserve("carol", 2 << 20, "a graph")
    a.release(), b.release()
    assert account.tenants == {} and account.refusals == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_answer_on_the_gpu_is_digested_there_and_names_its_tensors():
    from splitlearn.server.engine.ledger import answer_digests

    torch.manual_seed(0)
    h = torch.randn(2, 8, 16, device="cuda", dtype=torch.bfloat16)
    on_gpu = [Answer({"hidden": h}, {"step": "1"}), Answer({"hidden": h.clone()}, {"step": "1"}),
              Answer({"hidden": h + 1}, {"step": "1"}), Answer({"hidden": h}, {"step": "2"}),
              Answer({"grad": h}, {"step": "1"})]
    d = answer_digests(on_gpu)
    assert d[0] == d[1] and len(set(d)) == 4  # values, metadata and names all count
    assert all(a._bytes is None for a in on_gpu)  # never encoded (no copy to host memory)
    cpu = Answer({"hidden": h.cpu()}, {"step": "1"})
    assert answer_digests([cpu]) == [digest_of(cpu.encode())]


def test_an_answers_socket_body_is_its_encoded_bytes():
    """Over TCP a host answer goes out as its encoded (and kept) bytes."""
    h = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    a = Answer({"hidden": h}, {"step": "1"})
    body = a.host_body()
    assert isinstance(body, bytes) and body is a._bytes and Answer.decode(body).tensors["hidden"].equal(h)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_answers_socket_body_is_one_pinned_copy():
    """Issue 42: a CUDA answer over TCP is copied once, device to pinned host memory, into the
    body's own buffer (not to pageable memory and then joined); the bytes are encode()'s."""
    h = torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16)
    a = Answer({"hidden": h}, {"step": "1"})
    body = a.host_body()
    assert isinstance(body, memoryview) and a._bytes is None  # not kept: the ledger digests it on the device
    assert bytes(body) == Answer({"hidden": h.cpu()}, {"step": "1"}).encode()
