#!/usr/bin/env python3
"""Prints the scorer's CUDA source (SCORER_CU of src/kernels.rs) as it is at a
git revision: the files of its include_str! list, joined by newlines, in the
order that revision's src/kernels.rs gives. For KVSWAP_FM_SOURCE (development:
compare kernel variants with one build; see .ci/gpu-build.sh FM_VARIANTS).
.ci/fm-sass.py loads scorer_source from here (rev None: the work tree)."""
import os, re, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scorer_source(rev):
    """SCORER_CU at git revision `rev`, or in the work tree when rev is None."""
    def read(path):
        if rev is None:
            return open(os.path.join(ROOT, path)).read()
        r = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"fm-source.py: git show {rev}:{path}: {r.stderr.strip()}")
        return r.stdout
    block = re.search(r"pub const SCORER_CU: &str = concat!\((.*?)\);", read("src/kernels.rs"), re.S)
    if not block:
        sys.exit(f"{rev or 'work tree'}: no SCORER_CU in src/kernels.rs")
    return "\n".join(read(f) for f in re.findall(r'include_str!\("\.\./([^"]+)"\)', block.group(1)))


if __name__ == "__main__":
    sys.stdout.write(scorer_source(sys.argv[1] if len(sys.argv) > 1 else "HEAD"))
