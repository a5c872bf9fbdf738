"""The GPU's measured bf16 (or f16) matmul rate: the yardstick the CUDA kernels' TFLOP/s
are a fraction of.

Times torch.matmul of two n x n matrices with CUDA events after warm-up calls and prints
one JSON line: median_ms and tflops (2 n^3 flops a call).

Run:  python3 gpu_matmul.py [--n 8192] [--dtype bf16|f16] [--runs 20]
"""
import argparse, json, statistics
import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    p.add_argument("--runs", type=int, default=20)
    a = p.parse_args()
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    x, y = (torch.randn(a.n, a.n, dtype=dt, device="cuda") for _ in range(2))
    for _ in range(3):
        torch.matmul(x, y)
    torch.cuda.synchronize()
    times = []
    for _ in range(a.runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(x, y)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    med = statistics.median(times)
    print(json.dumps({"impl": "torch-matmul", "torch": torch.__version__, "dtype": a.dtype, "n": a.n,
                      "median_ms": med, "tflops": 2.0 * a.n ** 3 / (med * 1e-3) / 1e12}))


if __name__ == "__main__":
    main()
