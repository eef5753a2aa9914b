"""The compute thread: one thread runs every tensor operation of the server."""
import threading

import pytest
import torch

from splitlearn.server.engine.compute import ComputeThread


def test_run_executes_on_one_thread_and_returns():
    c = ComputeThread()
    idents = {c.run(threading.get_ident) for _ in range(5)}
    assert len(idents) == 1 and threading.get_ident() not in idents
    assert c.run(lambda a, b=0: a + b, 2, b=3) == 5
    c.close()


def test_run_reraises_and_keeps_working():
    c = ComputeThread()
    with pytest.raises(ZeroDivisionError):
        c.run(lambda: 1 / 0)
    assert c.run(lambda: "still here") == "still here"
    c.close()


def test_run_from_the_compute_thread_does_not_deadlock():
    c = ComputeThread()
    assert c.run(lambda: c.run(lambda: c.on_thread())) is True
    assert not c.on_thread()
    c.close()


def test_torch_threads_applies_to_the_compute_thread():
    before = torch.get_num_threads()
    c = ComputeThread(torch_threads=1)
    assert c.run(torch.get_num_threads) == 1
    c.close()
    torch.set_num_threads(before)
    with pytest.raises(ValueError):
        ComputeThread(torch_threads=0)

