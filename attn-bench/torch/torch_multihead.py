"""PyTorch (CPU) MultiheadDilatedAttention (MAGNETO / LongNet layout): the multihead baseline.

q/k/v = x W^T + b, split into heads, head-group dilated attention (`dilated_attention`
of torch_dilated.py), merge heads, LayerNorm (eps 1e-5), out = x W_o^T + b_o. Same
flags and JSON line as torch_dilated.py (beside this file); flops add the four
projections (2 flops per multiply-add), backward counts 3x for them.

Run:  ~/.cache/torch-venv/bin/python torch_multihead.py --seq-len 8192 --heads 8 --head-dim 64
"""
import argparse, json, os, statistics, sys, time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_dilated import dilated_attention, flops  # noqa: E402


class MultiheadDilated(nn.Module):
    def __init__(self, embed, heads, segs, rates, causal):
        super().__init__()
        self.h, self.segs, self.rates, self.causal = heads, segs, rates, causal
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(embed, embed) for _ in range(3))
        self.norm = nn.LayerNorm(embed, eps=1e-5)
        self.out_proj = nn.Linear(embed, embed)

    def forward(self, x):
        b, n, e = x.shape
        split = lambda t: t.reshape(b, n, self.h, e // self.h)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        o = dilated_attention(q, k, v, self.segs, self.rates, self.causal).reshape(b, n, e)
        return self.out_proj(self.norm(o))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--segments", default="2048,4096,8192")
    p.add_argument("--dilations", default="1,2,4")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--backward", action="store_true")
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    segs = [int(x) for x in a.segments.split(",")]
    rates = [int(x) for x in a.dilations.split(",")]
    dt = torch.float32 if a.dtype == "f32" else torch.bfloat16
    e = a.heads * a.head_dim
    m = MultiheadDilated(e, a.heads, segs, rates, a.causal).to(dt)
    x = torch.randn(a.batch, a.seq_len, e, dtype=dt, requires_grad=a.backward)
    go = torch.randn(a.batch, a.seq_len, e, dtype=dt)

    def step():
        if a.backward:
            m(x).backward(go)
        else:
            with torch.no_grad():
                m(x)

    step()
    times = []
    for _ in range(a.runs):
        t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    med = statistics.median(times)
    att = flops(a.batch, a.seq_len, a.heads, a.head_dim, segs, rates, a.causal) * (3.5 if a.backward else 1.0)
    proj = 4 * 2.0 * a.batch * a.seq_len * e * e * (3.0 if a.backward else 1.0)
    print(json.dumps({"impl": "torch", "torch": torch.__version__, "device": "cpu",
                      "threads": torch.get_num_threads(), "median_ms": med * 1e3,
                      "gflop_per_s": (att + proj) / med / 1e9, "tokens_per_s": a.batch * a.seq_len / med}))


if __name__ == "__main__":
    main()
