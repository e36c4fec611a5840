#!/usr/bin/env python3
"""The timing method's floor on the PyTorch side: a CUDA graph of one and of
three tiny kernels, replayed and timed as ../shared/bench/torch_fm_baseline.py
times PyTorch (an event pair around each graph.replay(), median). Every
PyTorch row of the scorer table includes it, as kvswap's rows include
`launch_floor_us` (cuGraphLaunch from Rust).

  torch-graph-floor.py [--json out.json] [--baseline .gpu/torch_fm_baseline.py]
"""
import argparse, importlib.util, json

import torch


def baseline_median_us(path):
    """torch_fm_baseline.py's own timer (median_us), so the floor is timed as
    the baseline's rows are."""
    spec = importlib.util.spec_from_file_location("torch_fm_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.median_us


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--baseline", default=".gpu/torch_fm_baseline.py", help="the baseline whose timer to use")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    median_us = baseline_median_us(args.baseline)
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
        floor[n] = median_us(g.replay, args.reps)
        print(f"PyTorch graph of {n} tiny kernel(s): {floor[n]:.1f} us (event pair around graph.replay(), median of {args.reps})")
    if args.json:
        json.dump({"torch_graph_floor_us": floor[1], "torch_graph_floor3_us": floor[3]}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
