"""Whether the emulator's CUDA path of sage1 gives the CPU path's numbers (diagnostic, prints only)."""
import torch
from fa3_numerics.engine.backends import get_backend
from fa3_numerics.engine.inputs import DistInputs
from fa3_numerics.numerics.emulator import emulate, prepare
from fa3_numerics.numerics.recipe import get_recipe
from fa3_numerics.studies.validate import Case

r = get_recipe("sage1").recipe
c = Case(seqlen=1000, causal=True)
dist, params = c.data()
q, k, v = DistInputs(dist, tuple(params.items()), c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim, c.seed).draw()
rows = torch.arange(c.seqlen)
ker = get_backend("sage1").attention(r, q.cuda(), k.cuda(), v.cuda(), causal=True, q_index=rows.cuda(),
                                     rotation_seed=0, cache={}).cpu()
out = {}
for dev in ("cpu", "cuda"):
    qq, kk, vv = (t.to(dev) for t in (q, k, v))
    out[dev] = emulate(r, qq, kk, vv, causal=True).cpu()
    pre = prepare(r, qq, kk, vv, q_index=rows.to(dev), causal=True, cache={})
    out[dev + "_pre"] = [t.cpu() for t in (pre.q.values, pre.k.values)]
    print(f"emulator on {dev}: identical to the kernel {(out[dev] == ker).double().mean().item():.3f}")
print("q codes differing", int((out["cpu_pre"][0] != out["cuda_pre"][0]).sum()), "k codes differing",
      int((out["cpu_pre"][1] != out["cuda_pre"][1]).sum()), "outputs differing", int((out["cpu"] != out["cuda"]).sum()))
