"""One GPU queue simulated (CPU, seconds): the p99 time in system of equal requests under Poisson
arrivals, when each forward merges everything waiting ("all"), at most a fixed number of requests
("capK"), or the first forward of `runtime.merge_plan`'s plan ("plan"). A forward of k requests
costs `a + (1 - a) k` (a: the fixed share of a lone request's forward), so times are in lone
forwards and loads in shares of the unmerged capacity. Why the engine's forward node merges by the
plan (`EngineConfig.batch_merge`, default "tail"): W2's fixed share is ~0.13 on the H200.

Those forwards form the moment the device frees. `--pacing` also simulates when the node really
forms them (merging all): "depth2", `device_depth` 2 — the next batch forms as soon as at most one
is on the device (the first arrival during a forward forms it at once, later ones wait for it and
run in the batch after); "late", the same with `EngineConfig.batch_late_merge` — while one batch
runs, the next forms at 0.8 of its time less a margin of twice the launch (`--launch`, in lone
forwards: 0.05 ≈ W2's ~0.15 ms host launch of a ~3 ms forward).

    python benchmarks/sim_merge.py [--shares 0 0.05 0.13 0.3 0.5] [--loads 0.6 0.7 0.8 0.9]
                                   [--requests 200000] [--futures 0 2 4 16]
                                   [--json $OUT/sim_merge.json]
    python benchmarks/sim_merge.py --pacing --shares 0.2 0.3 --loads 0.7 0.76 0.85
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

from boundgen.runtime.merge_plan import WINDOW, first_forward


def poisson_arrivals(load: float, n: int, seed: int) -> list[float]:
    """n arrival times of a Poisson stream of `load` requests a lone forward."""
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(load)
        arrivals.append(t)
    return arrivals


def p99(times: list[float], n: int) -> float:
    """The p99 of the requests' times in system past the first 1 % (the empty start)."""
    times = sorted(times[n // 100 :])
    return times[int(0.99 * (len(times) - 1))]


def p99_time_in_system(load: float, share: float, policy, n: int, seed: int = 0) -> float:
    arrivals = poisson_arrivals(load, n, seed)
    clock, i, times = 0.0, 0, []
    while i < n:
        clock = max(clock, arrivals[i])
        j = i
        while j < n and arrivals[j] <= clock and j - i < WINDOW:
            j += 1
        k = max(1, min(j - i, policy(j - i, share)))
        clock += share + (1 - share) * k
        times += [clock - a for a in arrivals[i : i + k]]
        i += k
    return p99(times, n)


def p99_paced(
    load: float, share: float, late: bool, n: int, seed: int = 0, launch: float = 0.05
) -> float:
    """p99 time in system when a forward of everything waiting forms as `BatchingNode` forms it
    at `device_depth` 2 (`late`: with late merging), launched `launch` after it forms."""
    arrivals = poisson_arrivals(load, n, seed)
    starts: list[float] = []
    ends: list[float] = []
    times: list[float] = []
    free = slot = 0.0  # the device's next free time; when the leader slot is next free
    i = 0
    while i < n:
        form = max(slot, arrivals[i])
        running = [j for j in range(max(0, len(ends) - 2), len(ends)) if ends[j] > form]
        if len(running) >= 2:  # two on the device: wait until the older has run
            form = ends[running[0]]
            running = running[1:]
        if late and running and starts[running[-1]] <= form:
            s, e = starts[running[-1]], ends[running[-1]]
            form = max(form, s + 0.8 * (e - s) - 2 * launch)
        j = i
        while j < n and arrivals[j] <= form:
            j += 1
        start = max(form + launch, free)
        free = start + share + (1 - share) * (j - i)
        starts.append(start)
        ends.append(free)
        times += [free - a for a in arrivals[i:j]]
        slot, i = form + launch, j
    return p99(times, n)


POLICIES = {
    "all": lambda queued, share: queued,
    "cap1": lambda queued, share: 1,
    "cap2": lambda queued, share: 2,
    "cap4": lambda queued, share: 4,
    "plan": lambda queued, share: first_forward([1.0] * queued, share, 1 - share, float("inf")),
}


def plan_with(future: float):
    """The plan with another `FUTURE` (`--futures`)."""
    return lambda queued, share: first_forward(
        [1.0] * queued, share, 1 - share, float("inf"), future=future
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.05, 0.13, 0.3, 0.5])
    ap.add_argument("--loads", type=float, nargs="+", default=[0.6, 0.7, 0.8, 0.9])
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--futures", type=float, nargs="*", default=[], help="plan variants")
    ap.add_argument("--pacing", action="store_true", help="depth2 against late (above)")
    ap.add_argument("--launch", type=float, default=0.05, help="--pacing: host launch, lone fwds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.pacing:
        rows = []
        print(f"p99 time in system, in lone forwards, merging all ({args.requests} a cell)")
        print(f"{'fixed share':>11} {'load':>5} {'depth2':>7} {'late':>7}")
        for share in args.shares:
            for load in args.loads:
                cells = {
                    name: p99_paced(load, share, name == "late", args.requests, launch=args.launch)
                    for name in ("depth2", "late")
                }
                rows.append({"fixed_share": share, "load": load, "p99": cells})
                print(f"{share:11.2f} {load:5.2f} {cells['depth2']:7.2f} {cells['late']:7.2f}")
        if args.json:
            common.write_json(args.json, {"env": common.env_info(), "pacing": rows})
        return
    policies = dict(POLICIES, **{f"plan{f:g}": plan_with(f) for f in args.futures})
    rows = []
    print(f"p99 time in system, in lone forwards ({args.requests} requests a cell)")
    print(f"{'fixed share':>11} {'load':>5} " + " ".join(f"{p:>6}" for p in policies))
    for share in args.shares:
        for load in args.loads:
            cells = {
                name: p99_time_in_system(load, share, fn, args.requests)
                for name, fn in policies.items()
            }
            rows.append({"fixed_share": share, "load": load, "p99": cells})
            line = " ".join(f"{v:6.2f}" for v in cells.values())
            print(f"{share:11.2f} {load:5.2f} {line}")
    if args.json:
        out = {"env": common.env_info(), "window": WINDOW, "rows": rows}
        common.write_json(args.json, out)


if __name__ == "__main__":
    main()
