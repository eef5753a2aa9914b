"""Per-operator FLOPs, bytes and the compute/memory-bound call."""
import pytest
import torch

from splitlearn.analysis.roofline import DevicePeaks, measure_peaks, profile_ops


def test_matmul_and_elementwise():
    a, b = torch.randn(64, 128), torch.randn(128, 32)
    ops = {o.op: o for o in profile_ops(lambda: (a @ b).relu())}
    mm = ops["mm"]
    assert mm.flops == 2 * 64 * 128 * 32
    assert mm.bytes == (64 * 128 + 128 * 32 + 64 * 32) * 4
    assert ops["relu"].flops == 64 * 32 and ops["relu"].bytes == 2 * 64 * 32 * 4
    ridge = DevicePeaks(1.0, 100.0, measured=False).ridge  # 10 FLOP/byte
    assert ridge == pytest.approx(10.0)
    assert mm.bound(ridge) == "memory" and mm.bound(mm.intensity) == "compute"


def test_given_peaks_are_not_measured():
    p = measure_peaks(torch.device("cpu"), torch.float32, tflops=2.0, mem_bw_gbs=50.0)
    assert (p.tflops, p.mem_bw_gbs, p.measured) == (2.0, 50.0, False)
    with pytest.raises(ValueError):
        DevicePeaks(0.0, 1.0, measured=False)
