"""Which Python of a running server holds the GIL: `py-spy record --gil` of its process for a
while (the samples are the thread holding the GIL), summarised by thread, by the innermost
boundgen frame and by leaf function.

    python benchmarks/gil_profile.py --pid PID --seconds 8 --out prof.txt    # record, summarise
    python benchmarks/gil_profile.py --summarise prof.txt                    # an earlier recording

py-spy counts an idle GIL for its last holder, so the shares say where the Python time goes
when the GIL is busy (a saturated server), not how contended it is; at low load they mislead.
`bench_tail.py --gil-profile SECONDS` records its server during a saturated step. py-spy must be
on PATH (`pip install py-spy`; the device carries it in `.whl`, `fetch_device_wheels.sh`) and
allowed to read the process (ptrace); where it is not, the error comes back instead of a summary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path


def record(pid: int, seconds: float, out: Path, rate: int = 200) -> subprocess.Popen | str:
    """Start recording `pid` for `seconds` into `out` (py-spy's raw format, each stack under its
    thread's name): the process, or why it could not start."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "py-spy not found on PATH"
    cmd = [spy, "record", "--pid", str(pid), "--gil", "--threads", "--format", "raw"]
    cmd += ["--rate", str(rate), "--duration", str(round(seconds)), "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen | str, out: Path, timeout_s: float = 60.0) -> dict:
    """Wait for `record`'s process and summarise its file (or say what went wrong)."""
    if isinstance(proc, str):
        return {"error": proc}
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"error": "py-spy did not finish"}
    if proc.returncode != 0 or not out.exists():
        return {"error": f"py-spy exited {proc.returncode}: {log.strip()[-500:]}"}
    return summarise(out)


def _where(frame: str) -> str:
    """`func (path/to/file.py:line)` → `func (dir/file.py)`."""
    name, _, loc = frame.partition(" (")
    path = loc.split(":")[0]
    return f"{name} ({'/'.join(path.split('/')[-2:])})"


def summarise(path: Path, top: int = 15) -> dict:
    """Shares of the GIL samples: by thread (its name, or else its outermost frame), by the
    innermost boundgen frame of the stack (else the leaf), and by leaf function."""
    total, threads, ours, leaves = 0, Counter(), Counter(), Counter()
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count, frames = int(n), stack.split(";")
        total += count
        # `--threads`: the first frame is "thread (TID): NAME"
        if frames[0].startswith("thread (") and len(frames) > 1:
            threads[frames[0].partition(": ")[2]] += count
            frames = frames[1:]
        else:
            threads[_where(frames[0])] += count
        leaves[_where(frames[-1])] += count
        inner = next((f for f in reversed(frames) if "boundgen/" in f), frames[-1])
        ours[_where(inner)] += count
    if not total:
        return {"samples": 0}

    def shares(c: Counter) -> dict[str, float]:
        return {k: round(v / total, 4) for k, v in c.most_common(top)}

    return {
        "samples": total,
        "by_thread": shares(threads),
        "by_boundgen_frame": shares(ours),
        "by_leaf": shares(leaves),
    }


def under_load(pid: int, seconds: float, raw: Path, load, label: str) -> tuple[dict, dict]:
    """Run `load(seconds + 3)` (a saturated closed loop, returning its row) while py-spy records
    `seconds` of process `pid`'s GIL holders into `raw`; print the summary in a line under
    `label` and return (the load's row, marked `profiled`, and the summary)."""
    spy = record(pid, seconds, raw)
    row = load(seconds + 3) | {"profiled": "py-spy"}
    gil = finish(spy, raw)
    print(f"GIL holders ({label}): {json.dumps(gil)[:1500]}", flush=True)
    return row, gil


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pid", type=int)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--out", type=Path, default=Path("gil_profile.txt"))
    ap.add_argument("--summarise", type=Path, default=None, help="an earlier recording")
    args = ap.parse_args()
    if args.summarise is not None:
        result = summarise(args.summarise)
    elif args.pid is None:
        ap.error("--pid or --summarise")
    else:
        result = finish(record(args.pid, args.seconds, args.out), args.out, args.seconds + 60)
    print(json.dumps(result, indent=1))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
