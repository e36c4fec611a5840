#!/usr/bin/env python3
"""Prints the scorer's CUDA source (SCORER_CU of src/kernels.rs) as it is at a
git revision: the files of its include_str! list, joined by newlines, in the
order that revision's src/kernels.rs gives. For KVSWAP_FM_SOURCE (development:
compare kernel variants with one build; see .ci/gpu-build.sh FM_VARIANTS)."""
import re, subprocess, sys

rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
def show(path):
    r = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"fm-source.py: git show {rev}:{path}: {r.stderr.strip()}")
    return r.stdout

kernels_rs = show("src/kernels.rs")
block = re.search(r"pub const SCORER_CU: &str = concat!\((.*?)\);", kernels_rs, re.S)
if not block:
    sys.exit(f"{rev}: no SCORER_CU in src/kernels.rs")
files = re.findall(r'include_str!\("\.\./([^"]+)"\)', block.group(1))
sys.stdout.write("\n".join(show(f) for f in files))
