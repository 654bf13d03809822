"""cuDNN's FP8 forward on validate's causal n 2048 case (the one case the preset missed: F 0.0137, 26 O codes).

tests/fixtures/cudnn_causal_n2048_h200.npz (``tools/cut_cudnn_case_fixture.py``, from
``tools/device/dump_cudnn_case.py`` on the H200): head 1 of fp8-n2048-d128-h8-causal-p0.001s10-head, six query
rows (438, 893, 922 held 17 of the case's 26 differing codes; 100, 700, 900 did not), the keys and values
0..922 they see, the kernel's O codes, and its descales. The codes turn on the last float32 bit of cuDNN's
scale of S into log2 units: fl(fl(fl(attn_scale descale_q) descale_k) log2e) (``smath=cudnn``) gives every
code; FA3's fl(attn_scale log2e) fl(descale_q descale_k), one ulp above it here, misses 17.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fa3_numerics.numerics import emulator
from fa3_numerics.numerics.emulator import emulate, prepare
from fa3_numerics.numerics.recipe import get_recipe

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "cudnn_causal_n2048_h200.npz"
E4M3 = torch.float8_e4m3fn
MAX_CODE = 0x7E  # E4M3 448: the per-tensor descale is amax / 448


def _inputs():
    z = np.load(FIX)
    meta = json.loads(str(z["meta"]))
    ds = z["descales"].astype(np.float64)
    rows = torch.from_numpy(z["rows"]).long()
    nk = z["k8"].shape[0]
    n = nk + 1  # one position past every row's keys: invisible under the causal mask

    def tensor(codes_at: dict[int, np.ndarray] | np.ndarray) -> torch.Tensor:
        t = torch.zeros(n, z["q8"].shape[-1], dtype=torch.uint8)
        if isinstance(codes_at, np.ndarray):
            t[: codes_at.shape[0]] = torch.from_numpy(codes_at)
        else:
            for r, c in codes_at.items():
                t[r] = torch.from_numpy(c)
        # the extra position holds a 448 so that this slice's amax is the whole tensor's (448 descale):
        # prepare's per-tensor descale is then the kernel's
        t[n - 1, 0] = MAX_CODE
        return t.view(E4M3).double()[None, None]

    q = tensor({int(r): z["q8"][i] for i, r in enumerate(rows)}) * ds[0]
    k = tensor(z["k8"]) * ds[1]
    v = tensor(z["v8"]) * ds[2]
    return q, k, v, rows, torch.from_numpy(z["o8_kernel"]), ds, meta


def _codes(q, k, v, rows, ds, meta):
    r = dataclasses.replace(get_recipe("cudnn-fp8-fwd").recipe, out="fp32", oscale="none")
    y = emulate(r, q, k, v, causal=True, softmax_scale=meta["softmax_scale"], q_index=rows, scale_o=float(ds[5]))
    return y.float().clamp(-448, 448).to(E4M3).view(torch.uint8)[0, 0]


def _fa3_scale_log2(scale, qd, kd):
    # the form before: the host's fl(attn_scale log2e) times fl(descale_q descale_k)
    base = torch.tensor(float(torch.tensor(scale, dtype=torch.float32)) * emulator.LOG2E, dtype=torch.float32)
    return (base * (qd * kd).to(torch.float32)).to(torch.float32)


def test_fixture_reproduces_the_kernels_inputs():
    q, k, v, rows, _, ds, _ = _inputs()
    pre = prepare(get_recipe("cudnn-fp8-fwd").recipe, q, k, v, q_index=rows, causal=True)
    for t, d in ((pre.q, ds[0]), (pre.k, ds[1]), (pre.v, ds[2])):
        assert float(t.descale.reshape(-1)[0]) == pytest.approx(d, rel=0, abs=0)


def test_cudnn_scale_order_gives_every_code_on_the_causal_n2048_rows(monkeypatch):
    q, k, v, rows, o8, ds, meta = _inputs()
    got = _codes(q, k, v, rows, ds, meta)
    assert got.shape == o8.shape
    assert int((got != o8).sum()) == 0  # every code of the six rows
    # the two forms are one float32 ulp apart on this case's descales
    qd, kd = (torch.tensor(x, dtype=torch.float32) for x in ds[:2])
    new, old = emulator._cudnn_scale_log2(meta["softmax_scale"], qd, kd), _fa3_scale_log2(meta["softmax_scale"], qd, kd)
    assert torch.nextafter(new, torch.tensor(1.0)) == old
    # negative control: the form before misses the rows that carried the case's F, not the others
    monkeypatch.setattr(emulator, "_cudnn_scale_log2", _fa3_scale_log2)
    before = _codes(q, k, v, rows, ds, meta)
    per_row = (before != o8).sum(-1)
    assert int(per_row.sum()) >= 10
    assert {int(r) for r, d in zip(rows, per_row) if d} == {438, 893, 922}
