"""Capture real FlashAttention-3 FP8 forward outputs for offline (CPU) fidelity studies.

For each configuration this script

1. draws Q, K, V in float64 on the CPU from the paper's distribution as the library draws it
   (``fa3_numerics.data.distributions``, family ``outliers``, the config's p, sigma and seed;
   shapes (batch, heads, seqlen, dim) for q and (batch, kv_heads, seqlen, dim) for k and v), so
   that ``fidelity_from_dumps.py`` regenerates them from the config; files record it as
   ``inputs`` in their metadata;
2. quantises them to FP8 e4m3 with one descale per (batch, kv_head): ``descale = amax / 448``
   (for q the amax is taken over all query heads of a KV group, because the kernel's
   ``q_descale`` has shape (batch, kv_heads)), then ``clamp(x / descale, -448, 448)`` and a cast to
   ``torch.float8_e4m3fn`` (the clamp makes the cast saturating);
3. runs the FA3 kernel on the FP8 tensors (BF16 output) and, for comparison, on BF16 casts of the
   float64 inputs;
4. writes one safetensors file per configuration holding ``q8``, ``k8``, ``v8`` (uint8 views of the
   e4m3 bytes, kernel layout (batch, seqlen, heads, dim)), ``q_descale``, ``k_descale``,
   ``v_descale`` (float32, (batch, kv_heads)), ``o_fp8`` and ``o_bf16`` (bfloat16, kernel layout),
   ``lse_fp8`` and ``lse_bf16`` (float32, (batch, heads, seqlen)) when the kernel returns them, and
   metadata (config, seed, versions, kernel module, device, timings).

A final ``probes`` file holds small, targeted inputs whose outputs isolate single stages of the
kernel's arithmetic (see ``PROBES`` below).

Run it on the device machine with the device tool, after ``pip download``-ing the kernel wheel
``fa3-fwd==0.0.3`` into ``.whl/`` (git-ignored) and passing ``carry: [".whl"]``::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH && \
    PYTHONUNBUFFERED=1 python3 tools/device/dump_fa3.py --out "$OUT"

Without CUDA (or with ``--mock``) the kernel is replaced by a float32 stand-in so that the CPU
parts and the file layout can be checked anywhere; files written that way are marked
``kernel_module=mock`` in their metadata and must not be used as kernel data.
The files respect the device tool's limits on what comes back (at most 8 files, 16 MiB each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from common import sync

FP8_MAX = 448.0
# How Q, K and V are drawn, written into every file's metadata; fidelity_from_dumps.py refuses
# files drawn another way (the script's own draw order before it used the library's).
INPUTS = "fa3_numerics.data.distributions outliers (library draw)"


@dataclass
class Config:
    name: str
    batch: int = 1
    seqlen: int = 2048
    heads: int = 4
    kv_heads: int | None = None
    dim: int = 128
    causal: bool = False
    p: float = 0.001
    sigma: float = 10.0
    seed: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def hk(self) -> int:
        return self.kv_heads or self.heads


# Sizes keep every file under 16 MiB and the set under 60 MiB (device tool limits).
CONFIGS = [
    Config("s2048_h8_d128", heads=8),
    Config("s2048_h4_d128_causal", heads=4, causal=True),
    Config("s1000_h4_d128", seqlen=1000, heads=4),
    Config("s2048_h8_kvh2_d128", heads=8, kv_heads=2),
    Config("s2048_h4_d64", heads=4, dim=64),
    Config("s2048_h2_d256", heads=2, dim=256),
    Config("s2048_h4_d128_p0", heads=4, p=0.0),
]


# ----------------------------------------------------------------------------- data


def make_qkv(cfg: Config):
    """Float64 Q (b, h, s, d), K and V (b, hk, s, d), drawn on the CPU by the library."""
    from common import paper_qkv

    return paper_qkv(cfg.batch, cfg.heads, cfg.seqlen, cfg.dim, cfg.seed, kv_heads=cfg.hk, p=cfg.p,
                     sigma=cfg.sigma)


def descale_per_kv_head(x: torch.Tensor, hk: int) -> torch.Tensor:
    """amax / 448 per (batch, kv_head); x is (b, h, s, d) with h a multiple of hk."""
    b, h = x.shape[:2]
    amax = x.abs().reshape(b, hk, -1).amax(dim=-1)
    return (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny).to(torch.float32)


def quantize(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """Saturating cast of x / descale to e4m3; x (b, h, s, d), descale (b, hk)."""
    b, h = x.shape[:2]
    hk = descale.shape[1]
    d = descale.to(torch.float64).repeat_interleave(h // hk, dim=1)[:, :, None, None]
    return (x / d).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def to_kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """(b, h, s, d) -> contiguous (b, s, h, d)."""
    return x.transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------- kernel


def load_kernel(mock: bool):
    if mock or not torch.cuda.is_available():
        return None, "mock"
    try:
        import fa3_fwd_interface as mod
    except ImportError:
        import flash_attn_interface as mod  # upstream FA3 build
    return mod.flash_attn_func, mod.__name__


def mock_attn(q, k, v, softmax_scale, causal, q_descale=None, k_descale=None, v_descale=None,
              return_attn_probs=False):
    """Float32 stand-in with the kernel's signature, for CPU checks only."""
    b, sq, h, d = q.shape
    hk = k.shape[2]

    def deq(x, ds):
        x = x.to(torch.float32)
        if ds is not None:
            x = x * ds.repeat_interleave(h // hk if x.shape[2] == h else 1, dim=1)[:, None, :, None]
        return x

    qf, kf, vf = deq(q, q_descale), deq(k, k_descale), deq(v, v_descale)
    kf = kf.repeat_interleave(h // hk, dim=2)
    vf = vf.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * softmax_scale
    if causal:
        sk = k.shape[1]
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vf)
    o = o.to(q.dtype if q.dtype == torch.bfloat16 else torch.bfloat16)
    return (o, lse) if return_attn_probs else o


def call_kernel(fn, q, k, v, scale, causal, descales=None):
    kw = dict(softmax_scale=scale, causal=causal, return_attn_probs=True)
    if descales is not None:
        kw.update(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    out = fn(q, k, v, **kw)
    if isinstance(out, (tuple, list)):
        o, lse = out[0], (out[1] if len(out) > 1 else None)
    else:
        o, lse = out, None
    return o, lse


# ----------------------------------------------------------------------------- runs


def run_fp8_and_bf16(fn, dev, q8, k8, v8, descales, qb, kb, vb, scale, causal):
    """q8/k8/v8 fp8 and qb/kb/vb bf16 in kernel layout on the CPU; returns CPU results + timings."""
    t = {}
    qd, kd, vd = (x.to(dev) for x in (q8, k8, v8))
    ds = tuple(x.to(dev) for x in descales)
    sync(dev)
    t0 = time.perf_counter()
    o8, lse8 = call_kernel(fn, qd, kd, vd, scale, causal, ds)
    sync(dev)
    t["fp8_s"] = time.perf_counter() - t0
    o8b, _ = call_kernel(fn, qd, kd, vd, scale, causal, ds)
    t["repeat_identical"] = bool(torch.equal(o8, o8b))
    out = {"o_fp8": o8.cpu().contiguous()}
    if lse8 is not None:
        out["lse_fp8"] = lse8.float().cpu().contiguous()
    if qb is not None:
        qd, kd, vd = (x.to(dev) for x in (qb, kb, vb))
        sync(dev)
        t0 = time.perf_counter()
        ob, lseb = call_kernel(fn, qd, kd, vd, scale, causal)
        sync(dev)
        t["bf16_s"] = time.perf_counter() - t0
        out["o_bf16"] = ob.cpu().contiguous()
        if lseb is not None:
            out["lse_bf16"] = lseb.float().cpu().contiguous()
    return out, t


def u8(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def run_config(cfg: Config, fn, dev):
    t0 = time.perf_counter()
    q, k, v = make_qkv(cfg)
    dq = descale_per_kv_head(q, cfg.hk)
    dk = descale_per_kv_head(k, cfg.hk)
    dv = descale_per_kv_head(v, cfg.hk)
    q8, k8, v8 = (to_kernel_layout(quantize(x, d)) for x, d in ((q, dq), (k, dk), (v, dv)))
    qb, kb, vb = (to_kernel_layout(x.to(torch.bfloat16)) for x in (q, k, v))
    t_gen = time.perf_counter() - t0
    scale = 1.0 / math.sqrt(cfg.dim)
    out, t = run_fp8_and_bf16(fn, dev, q8, k8, v8, (dq, dk, dv), qb, kb, vb, scale, cfg.causal)
    tensors = {"q8": u8(q8), "k8": u8(k8), "v8": u8(v8),
               "q_descale": dq, "k_descale": dk, "v_descale": dv, **out}
    t["gen_s"] = t_gen
    t["total_s"] = time.perf_counter() - t0
    meta = {"config": json.dumps(asdict(cfg)), "softmax_scale": repr(scale), "inputs": INPUTS}
    return tensors, meta, t


# Probes: inputs chosen so that one stage of the kernel's arithmetic shows in the output.
#  q0_*   : Q = 0, so every score is 0, the running max is 0 and every P~ is exp2(8) = 256
#           exactly; O = sum_j 256 * v_j / (256 * Sk): the P.V accumulation in isolation.
#           v is N(0,1) (signed) or |N(0,1)| (one sign, the accumulator only grows).
#  onehot : Sk = 128 = d (one KV tile), V = identity (v8 = 1 on the diagonal, v_descale 1),
#           so O[i, j] = bf16(fp8(P~_ij) / rowsum_i): the exp2, the offset, the cast of P and
#           the normalisation, without any accumulation over keys.
#  sk1    : Sk = 1, so the row max is the single score and lse reveals S = q.k in fp32
#           (tests how the Q.K^T product is accumulated over the head dim).
def run_probes(fn, dev, seed=0):
    from fa3_numerics.data.distributions.paper import outliers_like

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed + 1234)
    tensors, timings = {}, {}
    one = torch.ones(1, 1, dtype=torch.float32)

    def fp8(x):
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    # q0: batch 1, 128 queries, 8 heads, Sk = 2048, d = 128 (K is irrelevant: ones).
    b, sq, h, sk, d = 1, 128, 8, 2048, 128
    q8 = torch.zeros(b, sq, h, d, dtype=torch.float32).to(torch.float8_e4m3fn)
    vraw = torch.randn(b, sk, h, d, generator=gen, dtype=torch.float64) * 64.0
    vraw[:, :, h // 2:] = vraw[:, :, h // 2:].abs()
    v8 = fp8(vraw)
    k8 = torch.ones(b, sk, h, d, dtype=torch.float32).to(torch.float8_e4m3fn)
    ones = one.expand(b, h).contiguous()
    out, t = run_fp8_and_bf16(fn, dev, q8, k8, v8, (ones, ones, ones), None, None, None,
                              1.0 / math.sqrt(d), False)
    tensors.update({"q0_v8": u8(v8), "q0_o": out["o_fp8"]})
    if "lse_fp8" in out:
        tensors["q0_lse"] = out["lse_fp8"]
    timings["q0_s"] = t["fp8_s"]

    # onehot: batch 1, 2048 queries, 2 heads, Sk = 128, d = 128; random q, k as in the paper.
    b, sq, h, sk, d = 1, 2048, 2, 128, 128
    qraw = outliers_like((b, sq, h, d), gen, 0.001, 10.0)
    kraw = outliers_like((b, sk, h, d), gen, 0.001, 10.0)
    dq = (qraw.abs().amax(dim=(1, 3)) / FP8_MAX).to(torch.float32)
    dk = (kraw.abs().amax(dim=(1, 3)) / FP8_MAX).to(torch.float32)
    q8 = fp8(qraw / dq.double()[:, None, :, None])
    k8 = fp8(kraw / dk.double()[:, None, :, None])
    v8 = torch.eye(d, dtype=torch.float32)[None, :, None, :].expand(b, sk, h, d).contiguous()
    v8 = v8.to(torch.float8_e4m3fn)
    ones = one.expand(b, h).contiguous()
    out, t = run_fp8_and_bf16(fn, dev, q8, k8, v8, (dq, dk, ones), None, None, None,
                              1.0 / math.sqrt(d), False)
    tensors.update({"onehot_q8": u8(q8), "onehot_k8": u8(k8), "onehot_q_descale": dq,
                    "onehot_k_descale": dk, "onehot_o": out["o_fp8"]})
    if "lse_fp8" in out:
        tensors["onehot_lse"] = out["lse_fp8"]
    timings["onehot_s"] = t["fp8_s"]

    # sk1: batch 1, 2048 queries, 4 heads, Sk = 1, d = 128, descales 1, scale 1.
    b, sq, h, sk, d = 1, 2048, 4, 1, 128
    q8 = fp8(torch.randn(b, sq, h, d, generator=gen, dtype=torch.float64) * 32.0)
    k8 = fp8(torch.randn(b, sk, h, d, generator=gen, dtype=torch.float64) * 32.0)
    v8 = fp8(torch.randn(b, sk, h, d, generator=gen, dtype=torch.float64) * 32.0)
    ones = one.expand(b, h).contiguous()
    out, t = run_fp8_and_bf16(fn, dev, q8, k8, v8, (ones, ones, ones), None, None, None,
                              1.0, False)
    tensors.update({"sk1_q8": u8(q8), "sk1_k8": u8(k8), "sk1_v8": u8(v8),
                    "sk1_o": out["o_fp8"][:, :8].contiguous()})
    if "lse_fp8" in out:
        tensors["sk1_lse"] = out["lse_fp8"]
    timings["sk1_s"] = t["fp8_s"]
    timings["total_s"] = time.perf_counter() - t0
    return tensors, {"probes": "q0 (scale 1/sqrt(128), descales 1), onehot (scale 1/sqrt(128), "
                               "v_descale 1), sk1 (scale 1, descales 1); see dump_fa3.py"}, timings


# ----------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "fa3_dumps"))
    ap.add_argument("--mock", action="store_true", help="use the float32 stand-in kernel")
    ap.add_argument("--only", nargs="*", help="config names to run (default: all + probes)")
    ap.add_argument("--no-probes", action="store_true")
    args = ap.parse_args(argv)

    from safetensors.torch import save_file

    os.makedirs(args.out, exist_ok=True)
    fn, modname = load_kernel(args.mock)
    dev = torch.device("cuda" if modname != "mock" else "cpu")
    if fn is None:
        fn = mock_attn
    versions = {
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "kernel_module": modname,
        "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
    }
    if modname != "mock":
        try:
            from importlib.metadata import version
            versions["kernel_dist"] = "fa3-fwd " + version("fa3-fwd")
        except Exception:  # noqa: BLE001 - best effort
            versions["kernel_dist"] = "unknown"
    print("versions", json.dumps(versions), flush=True)

    jobs = [c for c in CONFIGS if not args.only or c.name in args.only]
    total = 0
    for cfg in jobs:
        try:
            tensors, meta, t = run_config(cfg, fn, dev)
        except Exception as exc:  # noqa: BLE001 - keep the other configs going on the device
            print(f"config {cfg.name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            continue
        meta.update(versions)
        meta["seed"] = str(cfg.seed)
        meta["timings"] = json.dumps(t)
        meta["fp8_storage"] = "q8/k8/v8: uint8 view of float8_e4m3fn bytes, (b, s, h, d)"
        path = os.path.join(args.out, f"fa3_{cfg.name}.safetensors")
        save_file({k: x.contiguous() for k, x in tensors.items()}, path, metadata=meta)
        size = os.path.getsize(path)
        total += size
        o8, ob = tensors["o_fp8"].double(), tensors["o_bf16"].double()
        rmse = (o8 - ob).pow(2).mean().sqrt().item()
        print(f"config {cfg.name}: gen {t['gen_s']:.2f}s fp8 {t['fp8_s'] * 1e3:.1f}ms "
              f"bf16 {t['bf16_s'] * 1e3:.1f}ms total {t['total_s']:.2f}s "
              f"size {size / 2**20:.2f}MiB rmse(fp8,bf16) {rmse:.3e} "
              f"lse {'yes' if 'lse_fp8' in tensors else 'no'} "
              f"repeat_identical {t['repeat_identical']}", flush=True)
    if not args.no_probes and not args.only:
        try:
            tensors, meta, t = run_probes(fn, dev)
        except Exception as exc:  # noqa: BLE001
            print(f"probes: FAILED {type(exc).__name__}: {exc}", flush=True)
            return 1
        meta.update(versions)
        meta["timings"] = json.dumps(t)
        path = os.path.join(args.out, "fa3_probes.safetensors")
        save_file({k: x.contiguous() for k, x in tensors.items()}, path, metadata=meta)
        size = os.path.getsize(path)
        total += size
        print(f"probes: {json.dumps(t)} size {size / 2**20:.2f}MiB", flush=True)
    print(f"total {total / 2**20:.2f}MiB in {len(os.listdir(args.out))} files", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
