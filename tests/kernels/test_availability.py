"""The checks every hardware backend shares (``kernels/availability.py``), on GPUs this machine
does not have: a stand-in ``torch.cuda`` reports them."""

import pytest
import torch

from fa3_numerics.kernels import cudnn, fa3, sage
from fa3_numerics.kernels.availability import gpu_problem, load_problem, refusal


@pytest.fixture
def gpu(monkeypatch):
    def use(name: str, cap: tuple[int, int]):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: cap)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda idx=None: name)
    return use


def test_each_kernel_names_the_gpu_it_needs(gpu):
    gpu("NVIDIA A100", (8, 0))
    assert fa3.kernel_problem("cuda").startswith(
        "NVIDIA A100 is sm_80, not Hopper (the FA3 kernel is built for sm_90a: H100/H200)")
    assert cudnn.kernel_problem("cuda").startswith("NVIDIA A100 is sm_80; cuDNN's FP8 attention needs sm90 or later")
    assert not sage.kernel_problem("cuda").startswith("NVIDIA A100")  # sm80 is enough for SageAttention 1
    gpu("NVIDIA H200", (9, 0))
    assert fa3.kernel_problem("cpu").startswith("--device cpu: the FA3 kernel runs on the GPU; pass --device cuda")
    assert gpu_problem("cuda", lambda cap: cap == (9, 0), no_gpu="-", wrong_gpu="-", kernel="-") is None


def test_refusal_and_load_problem_are_one_line():
    assert refusal([]) is None
    assert refusal(["a", "b"]) == "a; b; meanwhile use --backend emulate"
    assert load_problem(lambda: None, "x", "hint") is None

    def broken():
        raise ImportError("libfoo.so: cannot open\nmore detail")

    assert load_problem(broken, "foo is installed but does not import", "pip install foo") == (
        "foo is installed but does not import (ImportError: libfoo.so: cannot open); pip install foo")
