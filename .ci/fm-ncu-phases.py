#!/usr/bin/env python3
"""Stall samples of a wgmma scoring kernel per phase of its SASS, from the CSV that
`.ci/gpu-run.sh sass` writes (ncu --page source --print-source sass --csv):
    python3 .ci/fm-ncu-phases.py gpu-out/ncu-sass.csv [KERNEL, default fm_score_wg_fp8] [--opcodes]
Phases by landmarks: the loop's back edge (a BRA after the MMA wait that
jumps above the first HGMMA) marks the loop; the HGMMAs and the
WARPGROUP.DEPBAR (wgmma wait) split it. Prints each phase's share of all
samples and of executed instructions, and its top stall reasons. --opcodes
adds the epilogue's samples per opcode, and for its FFMA / FMNMX / FADD lines
the split by whether two or more source registers fall in one register bank
(index mod 2; operands marked .reuse and RZ not counted)."""
import csv, re, sys

opcodes = "--opcodes" in sys.argv
argv = [a for a in sys.argv if a != "--opcodes"]
path = argv[1] if len(argv) > 1 else "gpu-out/ncu-sass.csv"
want = argv[2] if len(argv) > 2 else "fm_score_wg_fp8"
# The CSV holds one table per profiled launch, each after a "Kernel Name" row:
# the first launch of the kernel named `want` is summarised.
rows, kernel = [], None
for r in csv.reader(open(path)):
    if r and r[0] == "Kernel Name":
        if rows:
            break
        kernel = r[1] if len(r) > 1 else ""
    elif kernel == want:
        rows.append(r)
head_at = [i for i, r in enumerate(rows) if r and r[0] == "Address"]
if not head_at:
    sys.exit(f"{path}: no SASS table of {want}")
head = rows[head_at[0]]
col = {n: i for i, n in enumerate(head)}
data = [r for r in rows[head_at[0] + 1 :] if len(r) == len(head)]
reasons = [n for n in head if n.startswith("stall_") and "Not Issued" not in n]


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


addr = lambda r: int(r[col["Address"]], 16)
src = lambda r: r[col["Source"]]
data.sort(key=addr)
hgmma = [addr(r) for r in data if re.search(r"[HQ]GMMA", src(r))]
depbar = [addr(r) for r in data if "WARPGROUP.DEPBAR" in src(r)]
if not hgmma or not depbar:
    sys.exit("no HGMMA / QGMMA / WARPGROUP.DEPBAR: not a wgmma kernel's table")
dep = depbar[0]
top = end = None
for r in data:
    m = re.search(r"BRA (0x[0-9a-f]+)", src(r))
    if m and addr(r) > dep and int(m.group(1), 16) < hgmma[0]:
        top, end = int(m.group(1), 16), addr(r)
if top is None:
    sys.exit("loop back edge not found")
phases = [
    ("prologue", 0, top),
    ("loop top .. first HGMMA", top, hgmma[0]),
    ("MMA issue", hgmma[0], hgmma[-1] + 1),
    ("after issue .. wgmma wait", hgmma[-1] + 1, dep),
    ("wgmma wait", dep, dep + 1),
    ("epilogue", dep + 1, end + 1),
    ("tail", end + 1, 1 << 64),
]
total = sum(num(r[col[n]]) for r in data for n in reasons) or 1.0
executed = lambda r: num(r[col["Instructions Executed"]])
total_instr = sum(executed(r) for r in data) or 1.0
print(f"{'phase':26s} {'samples':>8s} {'instr':>7s}  top stall reasons (share of all samples)")
for name, lo, hi in phases:
    part = [r for r in data if lo <= addr(r) < hi]
    by = {n: sum(num(r[col[n]]) for r in part) for n in reasons}
    print(
        f"{name:26s} {100 * sum(by.values()) / total:7.1f}% {100 * sum(executed(r) for r in part) / total_instr:6.1f}%  "
        + ", ".join(f"{n[6:]} {100 * v / total:.1f}" for n, v in sorted(by.items(), key=lambda x: -x[1])[:5] if v > 0)
    )
print(f"samples {total:.0f}, warp instructions executed {total_instr:.0f}")

if opcodes:
    lo, hi = dep + 1, end + 1
    part = [r for r in data if lo <= addr(r) < hi]

    def opcode(text):
        t = text.strip().split()
        t = t[1:] if t and t[0].startswith("@") else t
        return t[0].split(".")[0] if t else "?"

    def bank_clash(text):
        ops = text.split(None, 2)[-1] if text.strip().startswith("@") else text.split(None, 1)[-1]
        regs = re.findall(r"\bR(\d+)(\.reuse)?", ops)[1:]  # sources (the first is the destination)
        banks = [int(n) % 2 for n, reuse in regs if not reuse]
        return any(banks.count(b) >= 2 for b in (0, 1))

    groups = {}
    for r in part:
        op = opcode(src(r))
        key = (op, bank_clash(src(r))) if op in ("FFMA", "FMNMX", "FADD") else (op, None)
        g = groups.setdefault(key, [0, 0.0, {}])
        g[0] += 1
        g[1] += executed(r)
        for n in reasons:
            g[2][n] = g[2].get(n, 0.0) + num(r[col[n]])
    print(f"\nepilogue by opcode ({want}): lines, samples per executed warp instruction, top reasons (share of the group's samples)")
    for (op, clash), (lines, ex, by) in sorted(groups.items(), key=lambda kv: -sum(kv[1][2].values())):
        smp = sum(by.values())
        tag = op + ("" if clash is None else (" bank-clash" if clash else " no-clash"))
        print(f"  {tag:20s} {lines:4d} lines {smp / max(ex, 1):6.3f} samples/instr  "
              + ", ".join(f"{n[6:]} {100 * v / max(smp, 1):.0f}%" for n, v in sorted(by.items(), key=lambda x: -x[1])[:4] if v > 0))
