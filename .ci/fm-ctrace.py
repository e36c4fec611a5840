#!/usr/bin/env python3
"""The FM_CTRACE call timelines of `.ci/gpu-run.sh defines` (or `variants`)
side by side: for every set whose bench logs hold FMCALL lines (built with
-DFM_CTRACE), the median over its traced calls of each phase, in us from the
first scoring block's start. Usage: fm-ctrace.py OUT_DIR [PREFIX] (PREFIX
default `defines`: reads OUT_DIR/PREFIX-NAME-bench*.log).

Columns: prologue (loops started, max over blocks), loop (warpgroup 0's
loops ended minus started, max), score end (the last scoring block's exit),
gap (to fm_select past its wait), select (its end), order (fm_order past
its wait to its end), total (fm_order's end). The stamps are thread 0's:
with more warpgroups per block than 3, a block's other warpgroups can end
after it."""
import glob, os, re, statistics, sys

FIELDS = {
    "start": r"score blocks start by (-?\d+)",
    "loop0": r"loops start by (-?\d+)",
    "loop1": r"loops end by (-?\d+)",
    "score_end": r"score end -?\d+ \.\. (-?\d+)",
    "sel_wait": r"select past wait -?\d+ \.\. (-?\d+)",
    "sel_end": r"\| select .*? end -?\d+ \.\. (-?\d+)",
    "ord_wait": r"order past wait -?\d+ \.\. (-?\d+)",
    "ord_end": r"loaded by -?\d+, end (-?\d+)",
}


def parse(line):
    out = {}
    for k, rx in FIELDS.items():
        m = re.search(rx, line)
        if m:
            v = int(m.group(1))
            if 0 <= v < 10**9:  # a slot left unset reads as a huge or negative value
                out[k] = v / 1000.0
    return out


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out_dir, prefix = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "defines"
    sets = {}
    for f in sorted(glob.glob(os.path.join(out_dir, f"{prefix}-*-bench*.log"))):
        name = re.sub(r"-bench\d+\.log$", "", os.path.basename(f))[len(prefix) + 1:]
        for line in open(f, errors="replace"):
            if line.startswith("FMCALL"):
                sets.setdefault(name, []).append(parse(line))
    if not sets:
        return
    cols = [
        ("prologue", lambda c: c["loop0"]),
        ("loop", lambda c: c["loop1"] - c["loop0"]),
        ("score end", lambda c: c["score_end"]),
        ("gap", lambda c: c["sel_wait"] - c["score_end"]),
        ("select", lambda c: c["sel_end"] - c["sel_wait"]),
        ("order", lambda c: c["ord_end"] - c["ord_wait"]),
        ("total", lambda c: c["ord_end"]),
    ]
    print("FM_CTRACE timelines, us from the first scoring block (median of each set's traced calls)")
    print(f"{'set':20s} {'calls':>5s} " + " ".join(f"{n:>9s}" for n, _ in cols))
    for name, calls in sorted(sets.items()):
        row = []
        for _, f in cols:
            vals = []
            for c in calls:
                try:
                    vals.append(f(c))
                except KeyError:
                    pass
            row.append(f"{statistics.median(vals):9.1f}" if vals else f"{'-':>9s}")
        print(f"{name:20s} {len(calls):5d} " + " ".join(row))


if __name__ == "__main__":
    main()
