"""Micro-batch pipelining: the pipelined step equals the unpipelined one, both shapes, real server."""
import pytest
import torch

from splitlearn.client import SplitClient
from splitlearn.hf.pipeline import token_shares
from splitlearn.errors import ConfigError

from serverproc import TOKEN, InprocServerProcess
from test_client import LR

pytestmark = pytest.mark.slow


def test_token_shares_weight_micro_batches_by_their_targets():
    labels = torch.tensor([[1, 2, 3], [1, -100, -100], [4, 5, 6], [7, 8, -100]])
    # targets are the labels shifted by one: rows have 2, 0, 2 and 1 of them
    assert token_shares(labels, 2) == [2, 3]
    assert token_shares(labels, 4) == [2, 0, 2, 1]
    assert token_shares(labels, 3) == [2, 2, 1]  # rows 2, 1, 1


def batches():
    g = torch.Generator().manual_seed(3)
    out = []
    for pad in (0, 2, 5):
        ids = torch.randint(0, 256, (4, 12), generator=g)
        mask = None
        if pad:
            mask = torch.ones(4, 12, dtype=torch.long)
            mask[1, :pad] = 0
            mask[3, : pad // 2] = 0
        out.append((ids, mask))
    return out


# each case starts two servers: one optimizer per shape keeps the suite short (the micro-batch
# arithmetic is the optimizer's input, the same for both; AdamW's scale-invariance is why 2-way,
# where loss_scale matters most, runs SGD)
@pytest.mark.parametrize("cuts, optimizer", [((1, 3), "adamw"), ((2,), "sgd")], ids=["u-adamw", "2way-sgd"])
def test_pipelined_steps_equal_unpipelined_steps(cuts, optimizer, tmp_path):
    results = {}
    for micros in (1, 3):
        d = tmp_path / f"m{micros}"
        with InprocServerProcess(cuts, optimizer=optimizer, lr=LR[optimizer], checkpoint_dir=d) as srv:
            with SplitClient(srv.url, "tiny", token=TOKEN, optimizer=optimizer, lr=LR[optimizer], device="cpu",
                             micro_batches=micros) as c:
                losses = [c.train_step(ids, mask) for ids, mask in batches()]
                c.flush()  # the last step's apply (carried by the next step's first request)
                client = {k: v.clone() for s in c.segments for k, v in s.hf_state_dict().items()}
            results[micros] = (losses, client, srv.weights())
    (l1, c1, s1), (l3, c3, s3) = results[1], results[3]
    assert l1 == pytest.approx(l3, abs=1e-5)
    d = 32
    # AdamW divides by sqrt(v): a gradient the two summation orders give ~1e-9 apart moves a weight
    # by up to ~0.2% of a step (1.7e-5 at lr 1e-2, seen on some CPUs with either transformers 5.23
    # or 5.24); a wrong micro-batch gradient moves it by a whole step (~lr). 1% of a step separates them.
    tol = 1e-2 * LR[optimizer] if optimizer == "adamw" else 1e-5
    for a, b in ((c1, c3), (s1, s3)):
        for k in a:
            x, y = a[k], b[k]
            if optimizer == "adamw" and k.endswith("attn.c_attn.bias"):
                # The key bias's true gradient is exactly 0 (softmax ignores a constant added to
                # every score), so both runs carry only summation noise there, ~1e-10, which
                # AdamW's m / sqrt(v) blows up to lr-sized steps of either sign. Compare the rest.
                x, y = torch.cat([x[:d], x[2 * d:]]), torch.cat([y[:d], y[2 * d:]])
            assert torch.allclose(x, y, atol=tol), (k, (x - y).abs().max().item())


@pytest.mark.parametrize("bad", [0, -1, 65, 2.0, "3"])
def test_micro_batches_is_validated_before_any_request(bad):
    # port 9 (discard): nothing listens; the argument is refused before the client calls anyone
    with pytest.raises(ConfigError, match="micro_batches"):
        SplitClient("http://127.0.0.1:9", "tiny", token=TOKEN, device="cpu", micro_batches=bad)
