"""Start-up of `boundgen serve`: seconds from the process start until it answers at all (the port
is open) and until /health says ready (the warm-up done), each run a fresh process.

    python benchmarks/bench_startup.py --runs 5 -- --device cpu                     # demo model
    python benchmarks/bench_startup.py --runs 5 -- --device cpu --warmup off
    python benchmarks/bench_startup.py --runs 3 -- --model DIR --device cuda --backend aoti+graphs

Everything after `--` goes to `boundgen serve` (a free port is added). Prints min / median / max
and writes them as JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx

from boundgen.server.testing import free_port


def one_start(serve_args: list[str], timeout_s: float, log_path: str | None = None) -> dict:
    """Start `boundgen serve`, time it; `log_path`: its stderr, each line stamped with the seconds
    since the start (where the start-up time goes)."""
    port = free_port()
    cmd = [sys.executable, "-m", "boundgen.cli", "serve", "--port", str(port), *serve_args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:  # drained as it comes: a full pipe would stall the server
        for line in proc.stderr:
            lines.append(f"{time.monotonic() - t0:8.2f}  {line}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    listening = None
    try:
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                reader.join(5)
                raise RuntimeError(f"serve exited {proc.returncode}: {''.join(lines)[-2000:]}")
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code
            except httpx.HTTPError:
                time.sleep(0.02)
                continue
            if listening is None:
                listening = time.monotonic() - t0
            if status == 200:
                return {"listening_s": listening, "ready_s": time.monotonic() - t0}
            time.sleep(0.02)
        raise TimeoutError(f"not ready within {timeout_s} s")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.join(5)
        if log_path:
            with open(log_path, "w") as f:
                f.writelines(lines)


def main() -> int:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--log-prefix", default=None, help="write run i's stderr to PREFIX<i>.log")
    args = parser.parse_args(own)
    runs = []
    for i in range(args.runs):  # the first start of a machine can differ (caches): print each
        log_path = f"{args.log_prefix}{i + 1}.log" if args.log_prefix else None
        runs.append(one_start(serve_args, args.timeout_s, log_path))
        r = runs[-1]
        ready = f"listening {r['listening_s']:.2f} s, ready {r['ready_s']:.2f} s"
        print(f"run {i + 1}: {ready}", flush=True)
    out = {"serve_args": serve_args, "runs": runs, "cpu_count": os.cpu_count()}
    for key in ("listening_s", "ready_s"):
        values = sorted(r[key] for r in runs)
        out[key] = {"min": values[0], "median": statistics.median(values), "max": values[-1]}
        print(
            f"{key:12s} min {values[0]:.2f}  median {out[key]['median']:.2f}  max {values[-1]:.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
