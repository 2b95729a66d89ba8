"""W5 (DESIGN §9): HTTP end to end, open-loop arrivals at fixed QPS steps, p50/p99 and max QPS with
p99 <= 20 ms — boundgen and the HF transformers eager baseline side by side, in the same run.

Each server runs alone on the device (one after the other) on the same synthetic checkpoint; the
load generator is `boundgen.loadtest`. Writes `<out-dir>/w5_<workload>.json`, a PNG plot and a
Markdown table for BENCHMARKS.md.

    python benchmarks/bench_serving.py --device cuda --qps-steps 25 50 100 200 400 800 --duration 15
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from boundgen.loadtest import LoadConfig, plot_reports, run_loadtest

HERE = Path(__file__).resolve().parent


def serve_command(
    port: int, args: list[str], prelude: str = "", cpus: str | None = None
) -> list[str]:
    """`boundgen serve --port PORT --log-level warning ARGS`, after `prelude` (Python run in the
    server process first: an A/B hook, a fake GPU), pinned to `cpus` (taskset) when given."""
    code = f"{prelude}\nimport sys\nfrom boundgen.cli import main\nsys.exit(main())"
    cmd = [sys.executable, "-c", code, "serve", "--port", str(port), "--log-level", "warning"]
    cmd += args
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def start(
    cmd: list[str],
    url: str,
    log_path: Path,
    timeout_s: float = 600,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start a server (`env`: variables added to this process's for it) and wait until
    /health answers."""
    log = open(log_path, "w")  # noqa: SIM115 - the server process writes to it until it stops
    child_env = {**os.environ, **env} if env else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{cmd[:3]} exited with {proc.returncode}; see {log_path}:\n"
                + log_path.read_text()[-3000:]
            )
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{cmd[:3]} not ready after {timeout_s}s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_trie(
    out_dir: Path, items: int, depth: int, codes: int = 256, first_token: int = 1000, seed: int = 0
) -> Path:
    """A random semantic-ID trie (`items` distinct paths of `depth` codes) saved as .npy."""
    import numpy as np

    from boundgen import Trie

    rng = np.random.default_rng(seed)
    seqs = np.unique(rng.integers(0, codes, size=(int(items * 1.2) + 16, depth)), axis=0)
    seqs = seqs[rng.permutation(len(seqs))[:items]] + first_token
    path = out_dir / f"trie_{items}x{depth}.npy"
    Trie.from_sequences(seqs).save(path)
    return path


def markdown(reports: list[dict], slo_ms: float) -> str:
    """The steps table; `server` columns come from the responses' Server-Timing (the HF baseline
    sends none), and the slowest 1 % of each step are split into time inside and outside the
    server."""
    rows = [
        "| server | offered QPS | ok/s | p50 ms | p90 ms | p99 ms | server p50 / p99 ms | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    tails = []
    for rep in reports:
        for s in rep["steps"]:
            lat = s["latency_ms"]
            srv = s.get("server_ms")
            server = f"{srv['p50']:.2f} / {srv['p99']:.2f}" if srv else "–"
            rows.append(
                f"| {rep['label']} | {s['offered_qps']:.0f} | {s['throughput_qps']:.0f} | "
                f"{lat['p50']:.2f} | {lat['p90']:.2f} | {lat['p99']:.2f} | {server} | "
                f"{s['requests'] - s['ok']} |"
            )
            tail = s.get("slowest")
            if tail:
                top = sorted(tail["entries_ms"].items(), key=lambda kv: -kv[1])[:4]
                tails.append(
                    f"- {rep['label']} at {s['offered_qps']:.0f} QPS, slowest {tail['n']}: "
                    f"{tail['latency_ms']:.1f} ms = {tail['server_ms']:.1f} in the server + "
                    f"{tail['outside_ms']:.1f} outside; largest entries "
                    + ", ".join(f"{k} {v:.1f}" for k, v in top)
                )
    rows.append("")
    for rep in reports:
        rows.append(
            f"- {rep['label']}: max QPS with p99 <= {slo_ms:g} ms: **{rep['max_qps_within_slo']}**"
        )
    return "\n".join(rows + ([""] + tails if tails else []))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: make --preset)")
    p.add_argument(
        "--preset", default="qwen2.5-0.5b", help="synthetic checkpoint preset (DESIGN §9)"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--servers", nargs="+", default=["boundgen", "hf"], choices=["boundgen", "hf"])
    p.add_argument(
        "--workload",
        default="score",
        choices=["score", "beam", "mixed"],
        help="the HF baseline serves score only",
    )
    p.add_argument("--beam-width", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument(
        "--trie-items",
        type=int,
        default=0,
        help="beam/mixed: constrain beams by a random trie of this many items "
        "(depth = --steps, 256 codes per level)",
    )
    p.add_argument("--qps-steps", type=float, nargs="+", default=[25, 50, 100, 200, 400])
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--slo-ms", type=float, default=20.0)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument(
        "--client-processes",
        type=int,
        default=4,
        help="load generator processes (keeps client-side latency out of p99)",
    )
    p.add_argument("--serve-args", default="", help="extra `boundgen serve` flags, one string")
    p.add_argument("--out-dir", default=str(HERE / "results" / "serving"))
    args = p.parse_args(argv)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from boundgen.checkpoints import default_model_dir, make_model

        model = default_model_dir() / f"{args.preset}-bf16"
        if not (model / "config.json").exists():
            make_model(args.preset, model, dtype="bfloat16", overwrite=True)
    serve_args = args.serve_args.split()
    trie_name = None
    if args.trie_items and args.workload != "score":
        trie_name = "w4"
        serve_args += ["--tries", f"{trie_name}={make_trie(out_dir, args.trie_items, args.steps)}"]
    reports = []
    for i, name in enumerate(args.servers):
        port = args.port + i
        url = f"http://127.0.0.1:{port}"
        # A request that waited 2 s is dropped before the model runs, so an overloaded step does not
        # leave a backlog for the next one.
        common = [
            "--model",
            str(model),
            "--port",
            str(port),
            "--max-queue",
            "4096",
            "--timeout-ms",
            "2000",
            "--log-level",
            "warning",
        ]
        if name == "boundgen":
            cmd = [
                sys.executable,
                "-m",
                "boundgen.cli",
                "serve",
                *common,
                "--device",
                args.device,
                "--dtype",
                args.dtype,
                *serve_args,
            ]
        else:
            cmd = [
                sys.executable,
                str(HERE / "baseline_hf_server.py"),
                *common,
                "--device",
                args.device,
                "--dtype",
                args.dtype,
            ]
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        proc = start(cmd, url, out_dir / f"{name}.log")
        try:
            cfg = LoadConfig(
                url=url,
                workload=args.workload,
                qps_steps=tuple(args.qps_steps),
                duration=args.duration,
                slo_ms=args.slo_ms,
                warmup=args.warmup,
                beam_width=args.beam_width,
                steps=args.steps,
                trie=trie_name,
                processes=args.client_processes,
                label=name,
            )
            report = run_loadtest(cfg)
            metrics = httpx.get(url + "/metrics").text
            report["server_metrics_tail"] = metrics[-20000:]
            # what must stay 0 under load (compiles after ready), and what the graphs and the
            # admission did
            keys = ("boundgen_compiles_after_ready", "boundgen_beam_graph", "boundgen_shed")
            report["server_counters"] = {
                line.split(" ")[0]: float(line.split(" ")[-1])
                for line in metrics.splitlines()
                if line.startswith(keys)
            }
            print(json.dumps(report["server_counters"]), flush=True)
            reports.append(report)
        finally:
            stop(proc)
    stem = out_dir / f"w5_{args.workload}"
    env = {
        "device": args.device,
        "dtype": args.dtype,
        "model": str(model),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    Path(f"{stem}.json").write_text(json.dumps({"env": env, "reports": reports}, indent=1))
    plot_reports(
        reports,
        f"{stem}.png",
        title=f"W5 {args.workload} over HTTP, {Path(model).name}, {args.device}",
    )
    table = markdown(reports, args.slo_ms)
    Path(f"{stem}.md").write_text(table + "\n")
    print(table)
    print(f"wrote {stem}.json, {stem}.png, {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
