#!/usr/bin/env python3
"""Side-by-side table of kvswap's scorer benchmark (kvswap bench --scorer --json)
and the PyTorch baseline (shared/bench/torch_fm_baseline.py --json, one file per
scope), measured in the same GPU session.

  fm-compare.py kvswap-fm.json torch-score.json torch-full.json [torch-floor.json]

torch-floor.json (.ci/torch-graph-floor.py): the timing method's floor on the
PyTorch side, printed beside kvswap's (launch_floor_us).
"""
import json
import sys

ORIGINAL_ENGINE_US = 10_000.0  # the reference engine's +10 ms per token for global scoring


def main():
    kv = json.load(open(sys.argv[1]))
    torch, floor = {}, None
    for path in sys.argv[2:]:
        t = json.load(open(path))
        if "torch_graph_floor_us" in t:
            floor = t
            continue
        for row in t["rows"]:
            torch[(t["args"]["scope"], row["chunks"])] = row["score_topk_graph_us"]
    print(f"# {kv['device']}: kvswap beside PyTorch (CUDA-graph replay, same shapes, same session)")
    print("# kvswap_us and torch_us: one call per graph, median of event-timed replays (the baseline's method);")
    print("# back2back_us: kvswap per call of 20 calls in one graph (a decode loop), for reference only")
    read = f" (a streaming read reaches {kv['read_gbps']:.0f} GB/s)" if "read_gbps" in kv else ""
    print(f"# floor = bytes read once / {kv['copy_gbps']:.0f} GB/s measured device copy{read}; PyTorch has no fp8 path: "
          "fp8 rows are compared with PyTorch on bf16 keys")
    if "launch_floor_us" in kv:
        torch_floor = f", PyTorch {floor['torch_graph_floor_us']:.1f} us (one tiny kernel, graph.replay() from Python)" if floor else ""
        print(f"# the method's own floor, a graph of one kernel: kvswap {kv['launch_floor_us']:.1f} us (empty, cuGraphLaunch){torch_floor}; "
              "every row includes its side's")
    elif floor:
        print(f"# the method's own floor on PyTorch's side: {floor['torch_graph_floor_us']:.1f} us (a graph of one tiny kernel, graph.replay())")
    print(f"{'scope':>6} {'keys':>10} {'chunks':>9} {'kvswap_us':>10} {'back2back_us':>13} {'torch_us':>9} {'vs_torch':>9} "
          f"{'floor_us':>9} {'x_floor':>8} {'vs_10ms':>8}")
    for r in kv["rows"]:
        t = torch.get((r["scope"], r["chunks"]))
        vs = f"{t / r['kvswap_us']:.1f}x" if t else "-"
        ts = f"{t:.1f}" if t else "-"
        b2b = f"{r['back_to_back_us']:.1f}" if "back_to_back_us" in r else "-"
        v10 = f"{ORIGINAL_ENGINE_US / r['kvswap_us']:.0f}x" if r["scope"] == "full" else ""
        print(f"{r['scope']:>6} {r['keys']:>10} {r['chunks']:>9} {r['kvswap_us']:>10.1f} {b2b:>13} {ts:>9} {vs:>9} "
              f"{r['floor_us']:>9.1f} {r['ratio_to_floor']:>7.2f}x {v10:>8}")


if __name__ == "__main__":
    main()
