#!/usr/bin/env python3
"""The timing method's floor on the PyTorch side: a CUDA graph of one and of
three tiny kernels, replayed and timed as ../shared/bench/torch_fm_baseline.py
times PyTorch (an event pair around each graph.replay(), median). Every
PyTorch row of the scorer table includes it, as kvswap's rows include
`launch_floor_us` (cuGraphLaunch from Rust).

  torch-graph-floor.py [--json out.json]
"""
import argparse, json, statistics

import torch


def median_us(fn, reps=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(reps):
        a.record(); fn(); b.record(); b.synchronize()
        t.append(a.elapsed_time(b) * 1e3)
    return statistics.median(t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    x = torch.zeros(32, device="cuda")
    side = torch.cuda.Stream()
    floor = {}
    for n in (1, 3):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            for _ in range(3):
                x.add_(1)  # warm-up outside capture
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                for _ in range(n):
                    x.add_(1)
        floor[n] = median_us(g.replay)
        print(f"PyTorch graph of {n} tiny kernel(s): {floor[n]:.1f} us (event pair around graph.replay(), median of 200)")
    if args.json:
        json.dump({"torch_graph_floor_us": floor[1], "torch_graph_floor3_us": floor[3]}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
