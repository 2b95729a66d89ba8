"""Where a process's first AOTInductor package load goes (issue 23: "the first package load took
51 s, the other five 0.01 s each"). Each variant runs in a fresh child process, so nothing is
cached in memory:

    isa-torch     Inductor's CPU vector-ISA probe as torch runs it (`pick_vec_isa`)
    isa-remember  the same through `compile.isa.remember_isa_checks`, storing the verdicts
    isa-stored    again, the verdicts now stored: no child at all
    load-torch    `torch._inductor.aoti_load_package` of a cached package
    load-direct   `compile.aoti.open_package` of the same package (no device-information check)

    python benchmarks/diag_load.py --package DIR/package.pt2 --out diag.json

Prints one row per variant: seconds for `import torch`, the CUDA context, and the step itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t_import = time.perf_counter() - t0
t1 = time.perf_counter()
if torch.cuda.is_available():
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t_cuda = time.perf_counter() - t1
variant, arg = sys.argv[1], sys.argv[2]
t2 = time.perf_counter()
extra = {}
if variant.startswith("isa"):
    from torch._inductor import cpu_vec_isa
    probe = getattr(cpu_vec_isa.VecISA, "_avx_py_load", "")
    extra["child_imports_torch"] = "import torch" in probe.splitlines()
    if variant != "isa-torch":
        from boundgen.compile.isa import remember_isa_checks
        remember_isa_checks(arg)
    extra["isa"] = str(cpu_vec_isa.pick_vec_isa())
elif variant == "load-torch":
    torch._inductor.aoti_load_package(arg).get_constant_fqns()
else:
    from boundgen.compile.aoti import open_package
    open_package(arg).get_constant_fqns()
step = time.perf_counter() - t2
row = {"variant": variant, "import_s": t_import, "cuda_s": t_cuda, "step_s": step}
print(json.dumps({**row, **extra}))
"""


def run(variant: str, arg: str, timeout: float) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", CHILD, variant, arg], capture_output=True, text=True, timeout=timeout
    )
    wall = time.perf_counter() - t0
    line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("{")), None)
    if r.returncode != 0 or line is None:
        return {"variant": variant, "wall_s": wall, "error": r.stderr.strip()[-500:]}
    return {**json.loads(line), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", default=None, help="a cached package.pt2 (load variants)")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["isa-torch", "isa-remember", "isa-stored", "load-torch", "load-direct"],
    )
    ap.add_argument("--timeout-s", type=float, default=240.0)
    ap.add_argument("--verdicts", default=None, help="where isa-* keep verdicts (default: temp)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    verdicts = args.verdicts or tempfile.mkdtemp(prefix="isa-verdicts-")
    rows = []
    for v in args.variants:
        if v.startswith("load") and not args.package:
            continue
        row = run(v, verdicts if v.startswith("isa") else args.package, args.timeout_s)
        rows.append(row)
        print(
            f"{v:12s} wall {row['wall_s']:6.2f} s  import {row.get('import_s', 0):5.2f}  "
            f"cuda {row.get('cuda_s', 0):5.2f}  step {row.get('step_s', 0):6.2f}  "
            + (
                f"isa={row['isa']} child imports torch: {row['child_imports_torch']}"
                if "isa" in row
                else ""
            )
            + (f"ERROR {row['error'][-200:]}" if "error" in row else ""),
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
