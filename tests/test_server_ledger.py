"""The exactly-once step record: replay, expect-next, pending forwards, checkpoint counters."""
import pytest
import torch

from splitlearn.errors import Conflict
from splitlearn.server.ledger import Answer, Pending, StepLedger


def answer(x: float) -> Answer:
    return Answer({"grad": torch.full((2, 3), x)}, {"step": str(int(x))})


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
    assert led.replay("a", 1) is None
    first = answer(1)
    led.applied("a", 1, first)
    assert led.replay("a", 1) is first
    led.applied("a", 2, answer(2))
    assert led.replay("a", 1) is None  # an older step is not replayable: 409 from expect_next
    assert led.replay("a", 2).meta == {"step": "2"}


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
    assert back.replay("a", 2).encode() == led.replay("a", 2).encode()
    assert torch.equal(back.replay("b", 1).tensors["grad"], torch.full((2, 3), 7.0))
    assert back.pending("c") is None and back.replay("c", 0) is None
