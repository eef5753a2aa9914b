"""Shared fixtures: a tiny random GPT-2 (models/tiny.json), the byte tokenizer, and batches.

Everything runs offline on a CPU: the model is 4 blocks of width 32 over a 257-token byte
vocabulary, seeded, so every test sees the same weights.
"""
import itertools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the network in tests

import pytest
import torch

from splitlearn import ByteTokenizer, load_model
from splitlearn.model.segments import positions_from_mask

import forkserver
import slowfirst

# Test servers (``python -m splitlearn.server ...`` through LocalServer/ChildServer) are forked
# from a fork server that has imported torch and transformers once per xdist worker, instead of
# each spending ~9 CPU-seconds importing them (tests/forkserver.py); SPLITLEARN_FORK_SERVERS=0
# starts them as plain subprocesses.
if os.environ.get(forkserver.FORK_ENV, "1") == "1":
    forkserver.install()

torch.set_num_threads(1)  # tiny models; the CI machine's two cores are shared

N_LAYER = 4  # models/tiny.json
PROMPTS = ["Once upon a time", "Hi", "The cat sat on the mat."]


def all_cuts(n_layer: int = N_LAYER) -> list[tuple[int, ...]]:
    """Every valid cut tuple: (c,) for 0 <= c <= n, and (c1, c2) for 0 <= c1 < c2 <= n."""
    return [(c,) for c in range(n_layer + 1)] + list(itertools.combinations(range(n_layer + 1), 2))


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny spec, seeded random init, eval mode. Tests must not modify it."""
    model = load_model("tiny")
    assert model.config.n_layer == N_LAYER
    return model


#: the tiny shape initialised with std 0.3 (models/tiny-varied.json): its greedy tokens vary, so a
#: cache that drifts shows as wrong tokens (the tiny spec, at GPT-2's 0.02, repeats one token)
VARIED = "tiny-varied"


@pytest.fixture(scope="session")
def varied_model():
    """The tiny-varied spec, seeded random init, eval mode: the generation tests' reference."""
    return load_model(VARIED)


@pytest.fixture(scope="session")
def tokenizer():
    return ByteTokenizer()


@pytest.fixture
def padded_batch(tokenizer):
    """(input_ids, attention_mask), both (3, T), left-padded prompts of different lengths."""
    b = tokenizer(PROMPTS)
    return b["input_ids"], b["attention_mask"]


@pytest.fixture
def batch():
    """Unpadded input_ids (2, 12), seeded."""
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def hf_forward(model, input_ids, attention_mask=None, **kw):
    """The unsplit model, with positions derived from the mask as ``generate()`` does."""
    pos = positions_from_mask(attention_mask, input_ids.shape[1]) if attention_mask is not None else None
    return model(input_ids, attention_mask=attention_mask, position_ids=pos, **kw)


def pytest_configure(config):
    """`make test`'s serial phase (``-m serial``) starts its fork server before it collects: the
    fork server's ~9 CPU-seconds of imports overlap the collection on the other core instead of
    delaying the first test server (tests/forkserver.py, prestart)."""
    if config.option.markexpr == "serial" and os.environ.get(forkserver.FORK_ENV, "1") == "1":
        forkserver.prestart()


def pytest_collection_modifyitems(config, items):
    """`make test`'s serial phase collects only the files that contain ``pytest.mark.serial``
    (Makefile, SERIAL_FILES): a test marked serial another way would run in neither phase.
    On a pytest-xdist worker, the slowest files first (tests/slowfirst.py)."""
    if hasattr(config, "workerinput"):  # every worker collects the same order; the controller hands it out
        items[:] = slowfirst.ordered(items)
    marks = {}  # file -> whether it says so
    for item in items:
        if item.get_closest_marker("serial") is None:
            continue
        if item.path not in marks:
            marks[item.path] = "pytest.mark.serial" in item.path.read_text()
        if not marks[item.path]:
            raise pytest.UsageError(f"{item.nodeid} is marked serial without the words pytest.mark.serial "
                                    "in its file: make test's serial phase would not collect it")
