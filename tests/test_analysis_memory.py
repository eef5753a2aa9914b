"""Peak memory: resident weights counted once, and the tracker's peaks for a known allocation."""
import torch
from torch import nn

from splitlearn.analysis.memory import measure_peaks, resident_bytes


def test_resident_bytes_counts_shared_storage_once():
    lin = nn.Linear(10, 20)  # 200 + 20 floats
    assert resident_bytes(lin) == 220 * 4
    tied = nn.Module()
    tied.a, tied.b = lin, nn.Linear(10, 20)
    tied.b.weight = lin.weight
    assert resident_bytes(tied) == (220 + 20) * 4


class Grow(nn.Module):
    def forward(self, x):
        big = torch.ones(1024, 256)  # 1 MiB, freed on return
        return x + big.sum()


def test_peaks_see_a_temporary_allocation_in_the_submodule_and_the_run():
    m = nn.Sequential(Grow())
    x = torch.zeros(4)
    total, peaks = measure_peaks(lambda: m(x), {"0": m[0]}, torch.device("cpu"))
    assert peaks["0"] >= 1 << 20
    assert total >= peaks["0"]
    assert total < 4 << 20  # nothing else of that size happens
