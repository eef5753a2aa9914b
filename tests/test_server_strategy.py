"""splitlearn.server.federation.strategy: bounded updates, FedAvg / median / trimmed mean, float32 results."""
import math

import pytest
import torch

from splitlearn.errors import BadRequest, ConfigError
from splitlearn.server.federation.aggregate import capped_weights, update_norm
from splitlearn.server.federation.strategy import FedAvg, FedMedian, FedTrimmedAvg, coordinate_median, make_strategy

REF = {"w": torch.tensor([1.0, 2.0, 3.0]), "step": torch.tensor([7])}  # a float tensor and an int buffer


def up(values, n=1):
    return {"w": torch.tensor(values, dtype=torch.float32), "step": torch.tensor([99])}, n


def test_fedavg_is_the_sample_weighted_mean_in_float32_and_keeps_integer_buffers():
    agg = FedAvg(None).aggregate(REF, [up([2.0, 2.0, 2.0], 1), up([5.0, 6.0, 7.0], 3)])
    want = (torch.tensor([2.0, 2.0, 2.0], dtype=torch.float64) * 1 + torch.tensor([5.0, 6.0, 7.0]).double() * 3) / 4
    assert agg.weights["w"].dtype == torch.float32
    assert torch.equal(agg.weights["w"], want.float())
    assert torch.equal(agg.weights["step"], REF["step"])  # buffers: the reference's
    assert agg.clipped == [False, False]


def test_each_update_is_bounded_around_the_reference_not_the_upload():
    bound = 1.0
    agg = FedAvg(bound).aggregate(REF, [up([3e38, -3e38, 3e38], 1)])
    delta = agg.weights["w"].double() - REF["w"].double()
    assert agg.clipped == [True] and math.isclose(float(delta.norm()), bound, rel_tol=1e-6)
    assert bool(torch.isfinite(agg.weights["w"]).all())
    assert agg.norms[0] == pytest.approx(math.sqrt(3) * 3e38 * (1 + 1e-9), rel=1e-6)  # float64: no overflow
    # the direction is kept: (1, -1, 1) / sqrt(3)
    assert torch.allclose(delta.float(), torch.tensor([1.0, -1.0, 1.0]) / math.sqrt(3), atol=1e-6)


def test_an_honest_update_under_the_bound_is_untouched_bit_for_bit():
    w = {"w": torch.tensor([1.1, 2.2, 3.3]), "step": REF["step"]}
    agg = FedAvg(10.0).aggregate(REF, [(w, 5)])
    assert agg.clipped == [False] and torch.equal(agg.weights["w"], w["w"])


def test_claimed_samples_cannot_buy_more_than_the_bound():
    """A member claiming 10**12 samples moves the average by at most the bound (model replacement
    needs a boosted update; Sun et al. 2019)."""
    honest, evil = up([1.5, 2.5, 3.5], 2), up([50.0, 50.0, 50.0], 10**12)
    agg = FedAvg(1.0).aggregate(REF, [honest, evil])
    assert update_norm(REF, agg.weights) <= 1.0 + 1e-6
    assert not torch.allclose(agg.weights["w"], torch.full((3,), 50.0))


def test_median_and_trimmed_mean_ignore_an_outlier_and_its_samples():
    ups = [up([1.0, 2.0, 3.0], 1), up([1.2, 2.2, 3.2], 1), up([1.4, 2.4, 3.4], 1), up([1.1, 2.1, 3.1], 1),
           up([1000.0, -1000.0, 1000.0], 10**9)]
    med = FedMedian(None).aggregate(REF, ups)
    assert torch.allclose(med.weights["w"], torch.tensor([1.2, 2.1, 3.2]))  # the 3rd of 5 sorted values
    trimmed = FedTrimmedAvg(None, beta=0.2).aggregate(REF, ups)  # drops 1 value at each end per coordinate
    want = torch.tensor([(1.1 + 1.2 + 1.4) / 3, (2.0 + 2.1 + 2.2) / 3, (3.1 + 3.2 + 3.4) / 3])
    assert torch.allclose(trimmed.weights["w"], want, atol=1e-6)
    even = FedMedian(None).aggregate(REF, ups[:4])  # an even count averages the two middle values (numpy's median)
    assert torch.allclose(even.weights["w"], torch.tensor([1.15, 2.15, 3.15]))


def test_coordinate_median_is_the_fallback_reference():
    ref = coordinate_median([up([1.0, 5.0, 9.0])[0], up([3.0, 1.0, 8.0])[0], up([2.0, 2.0, 7.0])[0]])
    assert torch.equal(ref["w"], torch.tensor([2.0, 2.0, 8.0])) and ref["w"].dtype == torch.float32


def test_refusals():
    with pytest.raises(BadRequest):
        FedAvg(1.0).aggregate(REF, [])
    with pytest.raises(BadRequest):
        FedAvg(1.0).aggregate(REF, [up([1.0, 1.0, 1.0], 0)])
    for bad in (lambda: make_strategy("krum"), lambda: make_strategy("fedavg", 0.0),
                lambda: make_strategy("trimmed-mean", 1.0, 0.5)):
        with pytest.raises(ConfigError):
            bad()
    with pytest.raises(ConfigError, match="max-member-share"):
        make_strategy("fedavg", 1.0, 0.2, 0.0)
    assert make_strategy("median", None, max_share=None, max_update_ratio=None).describe() == {
        "aggregation": "median", "max_update_norm": None, "max_update_ratio": None, "max_member_share": None}
    with pytest.raises(ConfigError, match="max-update-ratio"):
        make_strategy("fedavg", max_update_ratio=0.0)
    assert make_strategy().describe()["max_member_share"] == 0.5  # the default: no member holds a majority


def test_an_inflating_member_holds_at_most_max_share_of_the_round():
    """Issue 29, item 9: a member whose counted tokens are 10**6 against two honest members' 2
    each gets exactly the cap (0.5) of the round's weight; the honest ones keep their ratio."""
    honest, evil = [up([1.5, 2.5, 3.5], 2), up([1.0, 3.0, 3.0], 2)], up([3.0, 3.0, 3.0], 10**6)
    agg = FedAvg(None, max_share=0.5).aggregate(REF, [*honest, evil])
    want = (0.25 * torch.tensor([1.5, 2.5, 3.5]).double() + 0.25 * torch.tensor([1.0, 3.0, 3.0]).double()
            + 0.5 * torch.tensor([3.0, 3.0, 3.0]).double())
    assert torch.allclose(agg.weights["w"].double(), want, atol=1e-6)
    assert agg.share_capped == [False, False, True]
    uncapped = FedAvg(None).aggregate(REF, [*honest, evil])  # without the cap it is the model, nearly
    assert torch.allclose(uncapped.weights["w"], torch.full((3,), 3.0), atol=1e-5)


def test_capped_weights():
    honest = [2, 4, 3]
    assert capped_weights(honest, 0.5) is honest  # nobody over the cap: the same ints, the same arithmetic
    w = capped_weights([10, 20, 30, 1000], 0.4)
    assert [x / sum(w) for x in w] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    w = capped_weights([1, 1, 50, 100], 0.3)  # two over the cap: both lowered to it
    assert [x / sum(w) for x in w] == pytest.approx([0.2, 0.2, 0.3, 0.3])
    assert capped_weights([1, 7], 0.5) == [1, 1]  # two members, cap 1/2: equal weights
    assert capped_weights([9], 0.5) == [9]  # one member holds its round
    assert capped_weights([1, 99], None) == [1, 99] and capped_weights([1, 99], 1.0) == [1, 99]


def test_the_default_bound_is_in_the_weights_own_scale():
    """Issue 50: --max-update-norm 100 alone exceeded tiny-demo's whole client side (norm 37). By
    default an update is also at most half the norm of the weights it updates: a member that
    uploads ten times the weights moves them by half their norm, on a small model as on a large."""
    for scale in (1.0, 10.0):  # a small model, a larger one: the same fraction
        ref = {"w": torch.tensor([3.0, 4.0]) * scale}  # norm 5 x scale
        evil = {"w": ref["w"] * 10}, 1
        agg = make_strategy("fedavg").aggregate(ref, [evil])
        moved = float((agg.weights["w"].double() - ref["w"].double()).norm())
        assert agg.clipped == [True] and moved == pytest.approx(min(0.5 * 5 * scale, 100.0), rel=1e-6)
        honest = {"w": ref["w"] * 1.1}, 1  # 0.1 of its norm: untouched, bit for bit
        assert torch.equal(make_strategy("fedavg").aggregate(ref, [honest]).weights["w"], honest[0]["w"])
    unbounded = make_strategy("fedavg", None, max_update_ratio=None).aggregate(REF, [up([3e3, 0.0, 0.0])])
    assert unbounded.clipped == [False]
    zero = {"w": torch.zeros(3)}  # a side of norm 0 (a LoRA B): --max-update-norm alone
    assert make_strategy("fedavg", 1.0).aggregate(zero, [({"w": torch.ones(3)}, 1)]).clipped == [True]
    assert make_strategy("fedavg", None).aggregate(zero, [({"w": torch.ones(3)}, 1)]).clipped == [False]
