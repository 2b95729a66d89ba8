"""`boundgen loadtest`: open-loop HTTP load against a running server (throughput, p50/p90/p99,
errors)."""

from __future__ import annotations

import argparse

from boundgen.settings import add_flags, from_args

HELP = (
    "open-loop HTTP load test of a server (/v1/score, /v1/beam): p50/p90/p99, errors, "
    "max QPS at a p99 SLO"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from boundgen.loadtest import LoadConfig

    add_flags(parser, LoadConfig)


def run(args: argparse.Namespace) -> int:
    from boundgen.loadtest import LoadConfig, run_loadtest

    cfg = from_args(LoadConfig, args)
    if not cfg.url.startswith(("http://", "https://")):
        raise ValueError(f"--url {cfg.url!r} needs its scheme: e.g. http://{cfg.url}")
    if cfg.qps <= 0 or any(q <= 0 for q in cfg.qps_steps) or cfg.duration <= 0:
        raise ValueError("--qps, --qps-steps and --duration must be positive")
    if cfg.plot:  # before the load runs, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise RuntimeError("--plot needs matplotlib: pip install 'boundgen[bench]'") from None
    report = run_loadtest(cfg)
    if cfg.out:
        print(f"wrote {cfg.out}")
    if cfg.plot:
        print(f"wrote {cfg.plot}")
    steps = report["steps"]
    return 0 if all(s["ok"] for s in steps) else 1
