"""Ray Serve's cost on one GPU: plain `boundgen serve` vs the same app behind Ray Serve, 1 replica.

In the same run, same checkpoint, same flags, same open-loop load (`boundgen.loadtest`): the cost
of one hop through Serve's proxy (requests one at a time), then throughput and p50/p99 per QPS
step, for the score (W2 over HTTP) and beam (W4 over HTTP) workloads. Writes
`<out-dir>/ray_vs_plain.json`, `.md` (table for BENCHMARKS.md) and one PNG per workload.

    python benchmarks/bench_ray.py --out-dir /tmp/out      # cuda, synthetic qwen2.5-0.5b, bf16
    python benchmarks/bench_ray.py --device cpu --dtype float32 --preset tiny \
        --score-qps 5 10 --beam-qps 2 --duration 3             # CPU dry run (~90 s)

Ray is not on the H200 image: its wheels travel with the working tree (the device tool carries at
most 64 MiB, and the ray wheel alone is 79 MB, so `--prepare-wheels` also drops the Java jar, the
dashboard's web client and RLlib from it: 43 MB, 49 MB with its deps). Here, once, in the repo
root:

    echo /.whl-ray/ >> .git/info/exclude
    python3 benchmarks/bench_ray.py --prepare-wheels .whl-ray

which runs exactly

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \\ --platform
        manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \\ -d
        .whl-ray ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
        referencing==0.37.0 rpds-py==0.30.0 grpcio==1.85.3 grpcio-reflection==1.85.1
        protobuf==7.36.2

and then slims the ray wheel in place. Why these: ray's own requirements missing from the image are
jsonschema (+ jsonschema-specifications, referencing, rpds-py); `ray.serve` imports grpc_reflection,
whose generated code insists on grpcio >= 1.85.1 and protobuf >= 7.35, so those two travel too (the
set tested together). fastapi, starlette, uvicorn and pydantic come from `.whl/` (the server's
wheels); click, filelock, msgpack, packaging, pyyaml, requests, aiohttp, uvloop, prometheus-client
are on the image. Nothing of Ray's "default" extra (dashboard, opencensus, ...) is needed: Ray runs
minimal, without a dashboard. The device command (one call, < 5 min; carry `.whl` and `.whl-ray`):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target
    /tmp/site
        .whl/*.whl .whl-ray/*.whl && export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 ||
        exit;
    timeout 280 python3 benchmarks/bench_ray.py --out-dir $OUT 2>&1 | tee $OUT/bench_ray.log
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

WHEELS = [
    "ray==2.60.0",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==0.30.0",
    "grpcio==1.85.3",
    "grpcio-reflection==1.85.1",
    "protobuf==7.36.2",
]
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# Never imported when serving over HTTP: the Java jar (32 MB), the dashboard's web client, RLlib.
RAY_STRIP = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/")


# ------------------------------------------------------------------------------------------- wheels


def download_cmd(dest: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
    ]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd + ["-d", dest, *WHEELS]


def slim_wheel(path: Path, strip: tuple[str, ...] = RAY_STRIP) -> Path:
    """Rewrite a wheel without the files under `strip` (RECORD updated; pip installs it as
    usual)."""
    tmp = path.with_suffix(".slim")
    with (
        zipfile.ZipFile(path) as src,
        zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst,
    ):
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        kept = []
        for info in src.infolist():
            if info.filename.startswith(strip) or info.filename == record_name:
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            kept.append(f"{info.filename},sha256={digest},{len(data)}")
        kept.append(f"{record_name},,")
        dst.writestr(record_name, "\n".join(kept) + "\n")
    tmp.replace(path)
    return path


def prepare_wheels(dest: str) -> int:
    Path(dest).mkdir(parents=True, exist_ok=True)
    cmd = download_cmd(dest)
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    for whl in Path(dest).glob("ray-*.whl"):
        before = whl.stat().st_size
        slim_wheel(whl)
        print(f"slimmed {whl.name}: {before / 1e6:.1f} MB -> {whl.stat().st_size / 1e6:.1f} MB")
    total = sum(f.stat().st_size for f in Path(dest).glob("*.whl"))
    print(f"{dest}: {total / 2**20:.1f} MiB in wheels (the device call carries <= 64 MiB in all)")
    return 0


# ------------------------------------------------------------------------------------------ servers


def wait_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}; {log_path}:\n"
                + log_path.read_text()[-4000:]
            )
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(
        f"server not ready after {timeout_s:.0f}s; {log_path}:\n" + log_path.read_text()[-4000:]
    )


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serial_latency(url: str, workload: str, n: int) -> dict:
    """`n` requests one at a time (1 in flight): the per-request cost of each hop, without
    queueing."""
    import statistics

    import httpx

    from boundgen.loadtest import LoadConfig, _pct, make_bodies

    cfg = LoadConfig(url=url, workload=workload)
    with httpx.Client(base_url=url, timeout=30) as client:
        vocab = int(client.get("/v1/models").json()["data"][0].get("vocab_size") or 1000)
        bodies = make_bodies(cfg, vocab)[workload]
        path = "/v1/score" if workload == "score" else "/v1/beam"
        headers = {"content-type": "application/json"}
        for body in bodies[:3]:
            client.post(path, content=body, headers=headers)
        ms = []
        for i in range(n):
            t0 = time.perf_counter()
            r = client.post(path, content=bodies[i % len(bodies)], headers=headers)
            ms.append((time.perf_counter() - t0) * 1e3)
            r.raise_for_status()
    ms.sort()
    return {
        "n": n,
        "p50": _pct(ms, 50),
        "p90": _pct(ms, 90),
        "p99": _pct(ms, 99),
        "mean": statistics.fmean(ms),
        "min": ms[0],
    }


def run_steps(url: str, label: str, workload: str, steps: list[float], args) -> dict:
    """Load steps in increasing QPS; stop after the first saturated one (ok/s < 90 % of offered
    or > 1 % errors): later steps would only queue, and the device time is better spent
    elsewhere. Then bisect `--refine` times between the last good step and the saturated one, so
    a coarse grid still pins the capacity (and max QPS within the SLO) to a few percent."""
    from boundgen.loadtest import LoadConfig, run_loadtest

    fields = {f.name for f in dataclasses.fields(LoadConfig)}
    extra = {"processes": args.client_processes} if "processes" in fields else {}
    reports = []

    def step(qps: float, first: bool) -> dict:
        cfg = LoadConfig(
            url=url,
            workload=workload,
            qps_steps=(qps,),
            duration=args.duration,
            slo_ms=args.slo_ms,
            warmup=args.warmup if first else 2,
            timeout_s=args.client_timeout_s,
            label=label,
            **extra,
        )
        rep = run_loadtest(cfg, log=lambda m: print(f"  [{label} {workload}] {m}", flush=True))
        reports.append(rep)
        return rep["steps"][0]

    def saturated(s: dict) -> bool:
        return s["throughput_qps"] < 0.9 * s["offered_qps"] or s["error_rate"] > 0.01

    good, bad = None, None
    for i, qps in enumerate(steps):
        if saturated(step(qps, i == 0)):
            bad = qps
            break
        good = qps
    for _ in range(args.refine if good is not None and bad is not None else 0):
        mid = round((good + bad) / 2, 1)
        if mid in (good, bad):
            break
        if saturated(step(mid, False)):
            bad = mid
        else:
            good = mid
    merged = dict(reports[0])
    merged["steps"] = sorted((r["steps"][0] for r in reports), key=lambda s: s["qps_target"])
    passing = [
        s["qps_target"]
        for s in merged["steps"]
        if s["latency_ms"]["p99"] <= args.slo_ms and s["error_rate"] <= 0.01
    ]
    merged["max_qps_within_slo"] = max(passing) if passing else None
    merged["max_throughput_qps"] = max(s["throughput_qps"] for s in merged["steps"])
    merged["max_unsaturated_qps"] = good
    return merged


def markdown(results: dict, slo_ms: float) -> str:
    rows = [
        "| workload | server | offered QPS | ok/s | p50 ms | p99 ms | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for workload, reports in results.items():
        for rep in reports:
            for s in rep["steps"]:
                lat = s["latency_ms"]
                rows.append(
                    f"| {workload} | {rep['label']} | {s['offered_qps']:.0f} | "
                    f"{s['throughput_qps']:.1f} | {lat['p50']:.2f} | {lat['p99']:.2f} | "
                    f"{s['requests'] - s['ok']} |"
                )
    rows.append("")
    for workload, reports in results.items():
        parts = [
            f"{r['label']}: max QPS at p99 <= {slo_ms:g} ms **{r['max_qps_within_slo']}**, "
            f"highest unsaturated step {r.get('max_unsaturated_qps')} QPS, "
            f"max ok/s {r['max_throughput_qps']:.1f}"
            for r in reports
        ]
        rows.append(f"- {workload}: " + "; ".join(parts))
        by = {r["label"]: r for r in reports}
        if (
            "plain" in by
            and "ray-1" in by
            and by["plain"].get("serial_ms")
            and by["ray-1"].get("serial_ms")
        ):
            sp, sr = by["plain"]["serial_ms"], by["ray-1"]["serial_ms"]
            rows.append(
                f"  - one request at a time (x{sp['n']}): plain p50 {sp['p50']:.2f} / p99 "
                f"{sp['p99']:.2f} ms, ray-1 p50 {sr['p50']:.2f} / p99 {sr['p99']:.2f} ms: "
                f"**proxy hop {sr['p50'] - sp['p50']:+.2f} ms p50, {sr['p99'] - sp['p99']:+.2f} "
                f"ms p99**"
            )
        if "plain" in by and "ray-1" in by:
            low_p = by["plain"]["steps"][0]["latency_ms"]
            low_r = by["ray-1"]["steps"][0]["latency_ms"]
            rows.append(
                f"  - proxy cost at the lowest step: p50 {low_r['p50'] - low_p['p50']:+.2f} ms, "
                f"p99 {low_r['p99'] - low_p['p99']:+.2f} ms; max ok/s ratio ray/plain "
                f"{by['ray-1']['max_throughput_qps'] / by['plain']['max_throughput_qps']:.2f}"
            )
        if "ray-1" in by and "ray-2" in by:
            one, two = by["ray-1"], by["ray-2"]
            slo = (
                f"{two['max_qps_within_slo'] / one['max_qps_within_slo']:.2f}x"
                if one["max_qps_within_slo"] and two["max_qps_within_slo"]
                else "n/a"
            )
            sat = (
                f"{two['max_unsaturated_qps'] / one['max_unsaturated_qps']:.2f}x"
                if one.get("max_unsaturated_qps") and two.get("max_unsaturated_qps")
                else "n/a"
            )
            rows.append(
                f"  - 2 replicas (one GPU each) vs 1: max QPS at p99 <= {slo_ms:g} ms {slo}, "
                f"highest unsaturated QPS {sat}, "
                f"max ok/s {two['max_throughput_qps'] / one['max_throughput_qps']:.2f}x"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--prepare-wheels",
        metavar="DIR",
        default=None,
        help="download + slim the Ray wheels for the H200 image into DIR, then exit",
    )
    p.add_argument("--model", default=None, help="checkpoint dir (default: make --preset)")
    p.add_argument(
        "--preset", default="qwen2.5-0.5b", help="synthetic checkpoint preset (DESIGN §9)"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--servers",
        nargs="+",
        default=["plain", "ray-1"],
        choices=["plain", "ray-1", "ray-2", "ray-2-shared"],
        help="ray-2: 2 replicas, one GPU each (2-GPU machines); ray-2-shared: 2 replicas on "
        "the one GPU (num_gpus=0.5 each), for host-bound engines",
    )
    p.add_argument("--workloads", nargs="+", default=["score", "beam"], choices=["score", "beam"])
    p.add_argument("--score-qps", type=float, nargs="+", default=[10, 20, 40, 80, 160, 320])
    p.add_argument("--beam-qps", type=float, nargs="+", default=[2, 5, 10, 20, 40])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per QPS step")
    p.add_argument(
        "--refine",
        type=int,
        default=2,
        help="extra steps bisecting between the last unsaturated and the first saturated QPS",
    )
    p.add_argument("--slo-ms", type=float, default=20.0)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument(
        "--serial-score",
        type=int,
        default=150,
        help="score requests sent one at a time before the QPS steps (hop cost)",
    )
    p.add_argument("--serial-beam", type=int, default=40)
    p.add_argument("--client-timeout-s", type=float, default=5.0)
    p.add_argument("--client-processes", type=int, default=2)
    p.add_argument(
        "--timeout-ms",
        type=int,
        default=2000,
        help="server deadline: overloaded steps end in 504s instead of a long queue",
    )
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--serve-args", default="", help="extra `boundgen serve` flags for both servers")
    p.add_argument("--startup-timeout-s", type=float, default=180)
    p.add_argument("--out-dir", default=str(HERE / "results" / "ray"))
    args = p.parse_args(argv)
    if args.prepare_wheels:
        return prepare_wheels(args.prepare_wheels)

    import httpx

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    model = args.model
    if model is None:
        from boundgen.checkpoints import default_model_dir, make_model

        model = default_model_dir() / f"{args.preset}-{args.dtype}"
        if not (model / "config.json").exists():
            make_model(args.preset, model, dtype=args.dtype, overwrite=True, progress=False)
    print(f"model {model} ready after {time.monotonic() - t_start:.0f}s", flush=True)
    common = [
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-queue",
        "4096",
        "--timeout-ms",
        str(args.timeout_ms),
        "--log-level",
        "warning",
        *args.serve_args.split(),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    results: dict[str, list[dict]] = {w: [] for w in args.workloads}
    servers: dict[str, dict] = {}
    stem = out_dir / "ray_vs_plain"

    def save() -> str:
        """Results so far (after every workload, so a run cut short still leaves a record)."""
        env_info = {
            "device": args.device,
            "dtype": args.dtype,
            "model": str(model),
            "python": sys.version.split()[0],
            "wall_s": time.monotonic() - t_start,
        }
        try:
            import ray

            env_info["ray"] = ray.__version__
        except ImportError:
            env_info["ray"] = None
        try:
            import torch

            env_info["torch"] = torch.__version__
            if torch.cuda.is_available():
                env_info["gpu"] = torch.cuda.get_device_name(0)
        except ImportError:
            env_info["torch"] = None
        Path(f"{stem}.json").write_text(
            json.dumps({"env": env_info, "servers": servers, "results": results}, indent=1)
        )
        table = markdown({w: r for w, r in results.items() if r}, args.slo_ms)
        Path(f"{stem}.md").write_text(table + "\n")
        return table

    for i, name in enumerate(args.servers):
        port = args.port + i
        url = f"http://127.0.0.1:{port}"
        if name == "plain":
            cmd = [sys.executable, "-m", "boundgen.cli", "serve", *common, "--port", str(port)]
        else:  # the same flags on Ray Serve: ray-N = N replicas of one GPU each, -shared: one GPU
            cmd = [
                sys.executable,
                "-m",
                "boundgen.serve_ray",
                *common,
                "--port",
                str(port),
                "--replicas",
                name.split("-")[1],
                "--num-cpus",
                "1",
            ]
            if name.endswith("-shared"):
                cmd += ["--num-gpus", "0.5" if args.device.startswith("cuda") else "0"]
        log_path = out_dir / f"{name}.log"
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        log_file = open(log_path, "w")  # noqa: SIM115 - closed in the finally below
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            startup = wait_ready(proc, url, log_path, args.startup_timeout_s)
            print(f"   ready in {startup:.1f}s", flush=True)
            servers[name] = {"cmd": cmd, "startup_s": startup}
            for workload in args.workloads:
                steps = args.score_qps if workload == "score" else args.beam_qps
                n_serial = args.serial_score if workload == "score" else args.serial_beam
                serial = serial_latency(url, workload, n_serial) if n_serial else None
                if serial:
                    print(
                        f"  [{name} {workload}] serial x{n_serial}: p50 {serial['p50']:.2f} ms  "
                        f"p99 {serial['p99']:.2f} ms  min {serial['min']:.2f} ms",
                        flush=True,
                    )
                rep = run_steps(url, name, workload, steps, args)
                rep["serial_ms"] = serial
                rep["startup_s"] = startup
                results[workload].append(rep)
                save()
            servers[name]["metrics_tail"] = httpx.get(url + "/metrics", timeout=10).text[-8000:]
        finally:
            stop(proc, timeout_s=60)
            log_file.close()
    table = save()
    try:
        from boundgen.loadtest import plot_reports

        for workload, reports in results.items():
            plot_reports(
                reports,
                out_dir / f"ray_vs_plain_{workload}.png",
                title=f"{workload}: plain boundgen serve vs Ray Serve (1 replica), "
                f"{Path(model).name}, {args.device}",
            )
    except Exception as exc:
        print(f"no plot: {exc}")
    print(table)
    print(f"wrote {stem}.json, {stem}.md in {time.monotonic() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
