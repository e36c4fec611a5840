#!/usr/bin/env python3
"""The scorer's kernels as ptxas and the SASS see them, on a machine without
a GPU (kernel development): compiles the scorer source (SCORER_CU of
src/kernels.rs, from the work tree or a git revision) with NVRTC as the CUDA
backend does for Hopper (3 scorers x 64 heads x 128 dims, wgmma, sm_90a,
plus any -D options given), then prints per kernel its registers, spills and
static SASS instruction count, or dumps one kernel's SASS.

  python3 .ci/fm-sass.py                      # table for the work tree
  python3 .ci/fm-sass.py --rev main -DFM_X=1  # a revision, extra NVRTC options
  python3 .ci/fm-sass.py --dump fm_score_wg_bf16 > /tmp/k.sass
  python3 .ci/fm-sass.py --compare main       # per kernel: SASS identical to main's?

NVRTC: libnvrtc.so.13 from .ci/.nvrtc (installed by .ci/run) or the loader
path. The SASS needs cuobjdump and nvdisasm; without them on PATH they are
fetched once from PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) into
.ci/.sass-tools (ignored by git)."""
import argparse, ctypes, glob, importlib.util, os, re, shutil, subprocess, sys, tempfile, zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS_PIN = "13.2.86"


def scorer_source(rev):
    """SCORER_CU at `rev` (None: the work tree), as .ci/fm-source.py reads it."""
    spec = importlib.util.spec_from_file_location("fm_source", os.path.join(ROOT, ".ci/fm-source.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.scorer_source(rev)


def load_nvrtc():
    for cand in sorted(glob.glob(os.path.join(ROOT, ".ci/.nvrtc/nvidia/cu13/lib/libnvrtc.so.13"))) + ["libnvrtc.so.13"]:
        try:
            return ctypes.CDLL(cand)
        except OSError:
            pass
    sys.exit("fm-sass.py: libnvrtc.so.13 not found (run .ci/run once, or put it on LD_LIBRARY_PATH)")


def compile_cubin(src, opts):
    lib = load_nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"scorer.cu", 0, None, None) != 0:
        sys.exit("fm-sass.py: nvrtcCreateProgram failed")
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    log = log.value.decode(errors="replace")
    if rc != 0:
        sys.exit(f"fm-sass.py: compile failed:\n{log}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    return cubin.raw, log


def sass_tools():
    if shutil.which("cuobjdump") and shutil.which("nvdisasm"):
        return os.path.dirname(shutil.which("cuobjdump"))
    bin_dir = os.path.join(ROOT, ".ci/.sass-tools/nvidia/cu13/bin")
    if not (os.path.exists(os.path.join(bin_dir, "cuobjdump")) and os.path.exists(os.path.join(bin_dir, "nvdisasm"))):
        with tempfile.TemporaryDirectory() as d:
            for pkg in ("nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"):
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", d, f"{pkg}=={TOOLS_PIN}"], check=True)
            for whl in glob.glob(os.path.join(d, "*.whl")):
                zipfile.ZipFile(whl).extractall(os.path.join(ROOT, ".ci/.sass-tools"))
        for tool in ("cuobjdump", "nvdisasm"):
            os.chmod(os.path.join(bin_dir, tool), 0o755)
    return bin_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", help="git revision (default: the work tree)")
    ap.add_argument("--dump", metavar="KERNEL", help="print this kernel's SASS instead of the table")
    ap.add_argument("--shape", default="3,64,128", help="scorers,heads,head_dim (default 3,64,128)")
    ap.add_argument("--compare", metavar="REV", help="per kernel, whether its SASS (addresses and encodings stripped) equals REV's "
                    "with the same options: a change that should not change the code, checked")
    # Extra NVRTC options (e.g. -DFM_B1_BYTES=48) are the arguments argparse
    # does not know: they start with "-", which it would take for options.
    a, extra = ap.parse_known_args()
    if bad := [o for o in extra if not o.startswith("-")]:
        ap.error(f"unrecognized arguments: {' '.join(bad)} (NVRTC options start with -, e.g. -DFM_B1_BYTES=48)")
    a.defines = extra
    s, h, d = (int(x) for x in a.shape.split(","))
    opts = [f"-DFM_SCORERS={s}", f"-DFM_HEADS={h}", f"-DFM_HEAD_DIM={d}", "-DFM_WGMMA", "--gpu-architecture=sm_90a",
            "--std=c++17", "--extra-device-vectorization", "-default-device", "--ptxas-options=-v"] + a.defines
    cubin, log = compile_cubin(scorer_source(a.rev), opts)
    tools = sass_tools()
    env = dict(os.environ, PATH=tools + os.pathsep + os.environ.get("PATH", ""))

    def disassemble(cubin):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            cmd = [os.path.join(tools, "cuobjdump"), "-sass"] + (["-fun", a.dump] if a.dump else []) + [f.name]
            return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout

    sass = disassemble(cubin)
    if a.compare:
        def per_kernel(text):
            out, fn = {}, None
            for line in text.splitlines():
                m = re.match(r"\s+Function : (\S+)", line)
                if m:
                    fn = m.group(1)
                    out[fn] = []
                elif fn and re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
                    out[fn].append(re.sub(r"/\*[^*]*\*/", "", line).strip())
            return out
        mine, theirs = per_kernel(sass), per_kernel(disassemble(compile_cubin(scorer_source(a.compare), opts)[0]))
        for k in sorted(set(mine) | set(theirs)):
            if k not in mine or k not in theirs:
                verdict = "only in " + ("the work tree" if k in mine else a.compare)
            elif mine[k] == theirs[k]:
                verdict = "identical"
            else:
                diff = sum(1 for x, y in zip(mine[k], theirs[k]) if x != y) + abs(len(mine[k]) - len(theirs[k]))
                verdict = f"differs ({len(mine[k])} vs {len(theirs[k])} instructions, {diff} lines differ)"
            print(f"{k:28s} {verdict}")
        return
    if a.dump:
        sys.stdout.write(sass)
        return
    usage, fn = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            fn = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m and fn:
            usage.setdefault(fn, {})["regs"] = int(m.group(1))
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and fn:
            usage.setdefault(fn, {})["spill"] = int(m.group(1)) + int(m.group(2))
    count, fn = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            fn = m.group(1)
            count[fn] = 0
        elif fn and re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
            count[fn] += 1
    print(f"{'kernel':28s} {'registers':>9s} {'spill B':>8s} {'SASS instr.':>11s}")
    for k in sorted(count):
        u = usage.get(k, {})
        print(f"{k:28s} {u.get('regs', '?'):>9} {u.get('spill', '?'):>8} {count[k]:>11d}")


if __name__ == "__main__":
    main()
