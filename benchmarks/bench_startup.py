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
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(serve_args: list[str], timeout_s: float) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "boundgen.cli", "serve", "--port", str(port), *serve_args]
    t0 = time.monotonic()
    # stderr to a file: a pipe nobody reads while the server starts could fill and stall it
    err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
    listening = None
    try:
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                err.seek(0)
                raise RuntimeError(f"serve exited {proc.returncode}: {err.read()[-2000:]}")
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
        err.close()


def main() -> int:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(own)
    runs = []
    for i in range(args.runs):  # the first start of a machine can differ (caches): print each
        runs.append(one_start(serve_args, args.timeout_s))
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
