"""The torch calls a score request makes from Python outside the model that give the GIL up.

Each call into torch's generated op bindings gives the GIL up and takes it back. Beside a thread
that runs Python (a server's event loop), taking it back waits until that thread lets go, up to
the interpreter's switch interval (5 ms): six `softmax` calls on 100 × 2 floats took 0.04 ms alone
and 25.7 ms beside a busy Python thread on the development CPU (`--convoy`). So on a server the
number of these calls on a request's path, not their work, sets much of its host time under load.

    python benchmarks/count_gil_trips.py [--requests 20] [--convoy] [--json OUT]   # + host_reads
    python benchmarks/count_gil_trips.py --device cuda --backend eager+graphs   # the GPU path

The request is W5's (query 256 ids, 100 items of 16, two labels, `apply_softmax`), through
`Engine.score` with a tiny model; the model's own eager forward is left out (a graphed backend's
replay is one call, and counts). With `--backend` other than eager the engine gets the request's
own cascade bucket (`--buckets`), so the staged graph path runs. Every torch C call is counted
first; then the same requests run beside a busy Python thread, and a call that took over 1 ms
there is one that gave the GIL up (the others, attribute reads and plain C helpers, take µs):
always where its median did, sometimes where two of its calls did (`release_kind`).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import threading
import time

import torch

from boundgen import Engine
from boundgen.checkpoints import make_model
from boundgen.models.decoder import DecoderModel

RELEASED_MS = 1.0  # a call slower than this beside a busy thread waited for the GIL


def release_kind(seconds: list[float]) -> str | None:
    """How a call's times beside the busy thread say it gives the GIL up: "always" where the
    median call took over `RELEASED_MS`; "sometimes" where at least two calls did — a call that
    gives the GIL up often takes it straight back before the busy thread wakes, so its median
    hides it (`.cpu()` of a host tensor: 4–8 % of its calls, `host_reads`); else None."""
    over = sum(t * 1e3 > RELEASED_MS for t in seconds)
    if seconds and statistics.median(seconds) * 1e3 > RELEASED_MS:
        return "always"
    return "sometimes" if over >= 2 else None


def _is_torch(fn) -> bool:
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.Tensor):
        return True
    module = getattr(fn, "__module__", None) or getattr(type(owner), "__module__", "") or ""
    return module.startswith("torch")


class Calls:
    """A profile hook: torch C calls by (thread, Python caller, name) while `on`, and each
    name's durations, skipping the model's own forward."""

    def __init__(self) -> None:
        self.on = False
        self.counts: collections.Counter = collections.Counter()
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)
        self.local = threading.local()

    def profile(self, frame, event, arg) -> None:
        if not self.on or getattr(self.local, "in_model", False):
            return
        if event == "c_call" and _is_torch(arg):
            caller = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"
            name = getattr(arg, "__name__", "?")
            self.counts[(threading.current_thread().name, caller, name)] += 1
            self.local.started = (name, time.perf_counter())
        elif event in ("c_return", "c_exception") and getattr(self.local, "started", None):
            name, t0 = self.local.started
            self.seconds[name].append(time.perf_counter() - t0)
            self.local.started = None


def _busy(stop: threading.Event) -> None:
    sys.setprofile(None)
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def _beside_busy_thread(fn) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=_busy, args=(stop,), name="busy")
    thread.start()
    try:
        fn()
    finally:
        stop.set()
        thread.join()


def convoy(ops: int = 6, rounds: int = 200) -> dict:
    """Median ms of `ops` small torch calls alone and beside a busy Python thread, per switch
    interval."""

    def timed() -> float:
        a = torch.randn(100, 2)
        ts = []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(ops):
                torch.softmax(a, -1)
            ts.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.001)
        return statistics.median(ts)

    out = {}
    default = sys.getswitchinterval()
    for interval in (default, 0.001, 0.0005):
        sys.setswitchinterval(interval)
        alone, beside = timed(), []
        _beside_busy_thread(lambda: beside.append(timed()))
        out[f"{interval * 1e3:g} ms"] = {
            "alone_ms": round(alone, 3),
            "beside_ms": round(beside[0], 3),
        }
    sys.setswitchinterval(default)
    return out


def host_reads(rounds: int = 400) -> dict:
    """A finished request's [100, 2] scores on the host to lists, beside a busy Python thread:
    `.cpu().tolist()` (a no-op copy that still gives the GIL up) against `.tolist()` alone. A
    call that gives the GIL up often takes it straight back before the busy thread wakes, so the
    median hides it: → per form, the median ms, the share of calls over 1 ms and the longest."""
    a = torch.rand(100, 2)
    out = {}

    def timed(fn) -> list[float]:
        ts = []
        for _ in range(rounds):
            time.sleep(0.0005)  # as a finishing request: just woken from a wait for the device
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return ts

    for name, fn in ((".cpu().tolist()", lambda: a.cpu().tolist()), (".tolist()", a.tolist)):
        ts = []
        _beside_busy_thread(lambda fn=fn: ts.extend(timed(fn)))
        out[name] = {
            "median_ms": round(statistics.median(ts), 4),
            "share_over_1ms": round(sum(t > RELEASED_MS for t in ts) / len(ts), 3),
            "max_ms": round(max(ts), 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--root", default="/tmp/boundgen-models/tiny-count")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--buckets", default="t1920-s104-m512-g2-p320-q1600", help="with --backend")
    ap.add_argument(
        "--convoy", action="store_true", help="also time small calls beside a busy thread"
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    calls = Calls()
    threading.setprofile(calls.profile)  # the engine's threads start after this
    sys.setprofile(calls.profile)
    path = make_model("tiny", args.root, arch="qwen2", seed=0, progress=False, overwrite=True)
    extra = {} if args.backend == "eager" else {"compile_buckets": args.buckets}
    if args.device != "cpu":
        extra["dtype"] = "bfloat16"  # as served
    engine = Engine.from_pretrained(path, device=args.device, backend=args.backend, **extra)
    forward = DecoderModel.forward

    def outside_the_count(self, *a, **k):
        calls.local.in_model = True
        try:
            return forward(self, *a, **k)
        finally:
            calls.local.in_model = False

    DecoderModel.forward = outside_the_count
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1, 1000) for _ in range(n)]
    query, items = ids(256), [ids(16) for _ in range(100)]
    score = lambda: engine.score(query, items, [5, 7], apply_softmax=True)
    for _ in range(3):  # warm-up: first-call caches (label weights, pinned blocks)
        score()
    calls.on = True
    for _ in range(args.requests):
        score()
    counts, calls.counts = calls.counts, collections.Counter()
    calls.seconds.clear()
    _beside_busy_thread(lambda: [score() for _ in range(max(4, args.requests // 2))])
    calls.on = False
    sys.setprofile(None)
    threading.setprofile(None)
    DecoderModel.forward = forward

    kind = {n: release_kind(s) for n, s in calls.seconds.items()}
    rows = [
        (thread if thread == "MainThread" else thread.rsplit("-", 1)[0], caller, name, n)
        for (thread, caller, name), n in counts.items()
    ]
    per_request = lambda keep: sum(n for *_, name, n in rows if keep(name)) / args.requests
    result = {
        "device": args.device,
        "backend": engine.runner.backend_name,
        "torch_calls_per_request": per_request(lambda name: True),
        "gil_trips_per_request": per_request(lambda name: kind.get(name) == "always"),
        "gil_trips_sometimes_per_request": per_request(lambda name: kind.get(name) == "sometimes"),
        "calls": [
            {
                "thread": t,
                "caller": c,
                "call": name,
                "per_request": n / args.requests,
                "gives_gil_up": kind.get(name) == "always",
                "sometimes_gives_gil_up": kind.get(name) == "sometimes",
                "share_over_1ms_beside_busy": round(
                    sum(t * 1e3 > RELEASED_MS for t in calls.seconds[name])
                    / len(calls.seconds[name]),
                    3,
                )
                if calls.seconds.get(name)
                else None,
                "median_ms_beside_busy": round(statistics.median(calls.seconds[name]) * 1e3, 3)
                if calls.seconds.get(name)
                else None,
            }
            for t, c, name, n in sorted(rows, key=lambda r: -r[3])
        ],
    }
    total, trips = result["torch_calls_per_request"], result["gil_trips_per_request"]
    print(
        f"{result['backend']} on {args.device}: {total:.1f} torch calls a request outside the "
        f"model, {trips:.1f} of them give the GIL up, "
        f"{result['gil_trips_sometimes_per_request']:.1f} more sometimes (gil?)"
    )
    for r in result["calls"]:
        mark = "GIL" if r["gives_gil_up"] else "gil?" if r["sometimes_gives_gil_up"] else "   "
        print(f"  {r['per_request']:5.1f} {mark} {r['thread']:24s} {r['caller']:34s} {r['call']}")
    if args.convoy:
        result["convoy"] = convoy()
        print("6 small torch calls, median ms (alone / beside a busy Python thread):")
        for interval, r in result["convoy"].items():
            print(f"  switch interval {interval}: {r['alone_ms']} / {r['beside_ms']}")
        result["host_reads"] = host_reads()
        print("host scores to lists beside a busy Python thread: median ms, share > 1 ms, max ms")
        for form, r in result["host_reads"].items():
            print(f"  {form:16s} {r['median_ms']} {r['share_over_1ms']} {r['max_ms']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
