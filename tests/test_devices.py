"""Device and dtype names as users type them."""
import pytest
import torch

from splitlearn.model.devices import dtype_name, resolve_device, resolve_dtype, synchronize
from splitlearn.errors import ConfigError


def test_dtypes():
    assert resolve_dtype(None) is None and resolve_dtype(torch.float16) is torch.float16
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("Float32") is torch.float32
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ConfigError, match="unknown dtype 'float8'"):
        resolve_dtype("float8")


def test_devices():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want and resolve_device(None).type == want
    assert resolve_device("cpu") == torch.device("cpu")
    dev = torch.device("cpu")
    assert resolve_device(dev) is dev
    synchronize(dev)  # a no-op on the CPU
    with pytest.raises(ConfigError, match="unknown device"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        resolve_device("cuda")
