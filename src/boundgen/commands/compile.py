"""boundgen compile: AOTInductor packages of the packed forward, one per shape bucket, into the
cache; the buckets given, or planned from a profile of typical requests or logged traffic."""

from __future__ import annotations

import json
import logging
import sys
import time

from boundgen.commands._common import add_engine_args

log = logging.getLogger("boundgen.compile")

HELP = "export + AOTInductor-compile the model's packed forward per shape bucket (weights kept out)"


def add_arguments(parser) -> None:
    add_engine_args(parser, model_required=False)
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="the `boundgen serve` config file (YAML/TOML) whose engine settings the artifacts are "
        "built for (e.g. fp8, fp8_force, attention); flags override it",
    )
    parser.add_argument(
        "--buckets",
        default=None,
        help="comma-separated buckets, e.g. 't64,t256,t2048-s64-m256,t4096-g8-p2048-q1536' "
        "(default: the ladder from 64 to --max-batch-tokens, see docs/compile.md)",
    )
    plan = parser.add_argument_group("planning buckets from traffic (instead of --buckets)")
    plan.add_argument(
        "--profile",
        default=None,
        help="JSON list of typical requests, e.g. "
        '\'[{"kind": "score", "query_tokens": 256, "items": 100, "item_tokens": 16, '
        '"count": 4}]\' (docs/compile.md)',
    )
    plan.add_argument(
        "--from-traffic",
        default=None,
        help="JSON lines of forward shapes a server logged (docs/compile.md)",
    )
    plan.add_argument(
        "--plan-only", action="store_true", help="print the planned buckets and padding, build none"
    )
    plan.add_argument(
        "--max-bucket-tokens", type=int, default=8192, help="tokens of the largest planned bucket"
    )
    plan.add_argument(
        "--max-cascade-buckets",
        type=int,
        default=8,
        help="most shared-prefix buckets (the closest shapes are merged)",
    )
    parser.add_argument(
        "--cache-dir", default=None, help="artifact cache (default: $BOUNDGEN_CACHE/compiled)"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="build buckets in this many processes (default 0: one per bucket, at most half the "
        "CPU cores and 8)",
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even when a valid artifact exists"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="only check the cache (hit / missing / stale / corrupt); build nothing",
    )
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the parity check against eager (the load check always runs: its verdict is "
        "stored with the artifacts so servers never pay it)",
    )
    parser.add_argument(
        "--json", dest="json_out", default=None, help="also write the summary as JSON here"
    )


def _table(rows: list[dict]) -> str:
    cols = [
        ("bucket", "bucket"),
        ("event", "cache"),
        ("export_s", "export s"),
        ("compile_s", "compile s"),
        ("size_mb", "size MB"),
        ("max_abs_diff", "max |Δ| vs eager"),
    ]
    cells = [[h for _, h in cols]]
    for r in rows:
        cells.append(
            [
                ""
                if r.get(k) is None
                else (f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]))
                for k, _ in cols
            ]
        )
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _load_note(diag: dict) -> str:
    note = f"load check: {diag['status']}"
    if diag["status"] == "preload":
        note += f" (servers re-exec with LD_PRELOAD={diag['preload']})"
    return note


def _verify(engine, entries, cache_root) -> str:
    """Compare each bucket with eager, loaded in this process (the load check has passed or this
    command re-execs itself with the preload first: never a crash)."""
    from boundgen.compile.aoti import SharedWeights
    from boundgen.compile.preload import AOTIUnsafe, ensure_loadable
    from boundgen.compile.verify import max_abs_diff

    try:
        # NOTE: this command may re-exec itself with the preload (everything built so far is cached)
        ensure_loadable(entries[0][1], cache_root, allow_reexec=True)
    except AOTIUnsafe as exc:
        return f"not verified in this process: {exc}"
    weights = SharedWeights(engine.model)
    for bucket, path, row in entries:
        diff = max_abs_diff(engine.model, bucket, path, weights)
        row["max_abs_diff"] = "n/a" if diff is None else diff
    return "verified against eager"


class _LoadCheck:
    """The AOTInductor load check (`compile.preload.diagnose`), started in the background as soon
    as the first package exists, so its child process overlaps the other builds; the verdict is
    stored in the cache when it ends (an interrupted compile keeps it)."""

    def __init__(self, cache_root) -> None:
        self.cache_root = cache_root
        self.thread = None
        self.result: dict | None = None

    def start(self, package) -> None:
        import threading

        from boundgen.compile.preload import diagnose

        if self.thread is not None:
            return

        def check() -> None:
            self.result = diagnose(package, self.cache_root)

        self.thread = threading.Thread(target=check, name="boundgen-load-check", daemon=True)
        self.thread.start()

    def wait(self) -> dict | None:
        if self.thread is not None:
            self.thread.join()
        return self.result


class _BeamLayers:
    """The beam search's layers compiled by `torch.compile` the way a server's default warm-up
    compiles them (`compile/decode.py`, `warmup.default_profile`'s beam search), their results
    saved into the cache (`compile.torch_cache`), where the server's warm-up loads them: the
    first start after a compile no longer pays them (~14 s of a 33 s start on the H200,
    2026-12-02). CUDA only (on CPU beam searches run eagerly). A thread beside the worker
    processes' builds; after them when this process builds itself (`torch.compile` here sets
    Inductor options the bucket builds must not see)."""

    def __init__(self, engine, cache_root) -> None:
        self.engine, self.cache_root = engine, cache_root
        self.thread = None
        self.note: str | None = None

    def start(self) -> None:
        import threading

        if self.engine.device.type != "cuda":
            return
        self.thread = threading.Thread(target=self.run, name="boundgen-beam-layers", daemon=True)
        self.thread.start()

    def run(self) -> None:
        from boundgen import warmup
        from boundgen.compile import torch_cache
        from boundgen.compile.backends import CompileOptions
        from boundgen.runner import make_runner

        t0 = time.perf_counter()
        engine = None
        try:
            runner = make_runner(
                self.engine.model,
                self.engine.device,
                backend="eager+graphs",
                options=CompileOptions(buckets="t64", compile_decode=True),
            )
            engine = self.engine.with_runner(runner)
            beams = [e for e in warmup.default_profile(engine) if e["kind"] == "beam"]
            warmup.run(warmup.requests(engine, beams), cache_root=self.cache_root)
            path = torch_cache.path_for(self.cache_root)
            size = path.stat().st_size / 1e6 if path.is_file() else 0.0
            self.note = (
                f"beam layers compiled in {time.perf_counter() - t0:.1f} s "
                f"(torch.compile cache {size:.1f} MB)"
            )
        except Exception as exc:  # the buckets stand without it: a server compiles at warm-up
            log.warning("beam layers not compiled ahead: %s", exc, exc_info=True)
            self.note = f"beam layers not compiled ahead ({type(exc).__name__}: {exc})"[:300]
        finally:
            if engine is not None:
                engine.close()

    def wait(self) -> str | None:
        if self.thread is not None:
            self.thread.join()
        return self.note


def _jobs(requested: int, buckets: int) -> int:
    """Worker processes: `requested`, or (0) one per bucket, at most half the usable cores (a
    container's CPU limit counts, `host_cores`) and 8 — each worker holds a copy of the model and
    runs Inductor's own compile threads."""
    from boundgen.host_cores import usable_cores

    if requested > 0:
        return requested
    return max(1, min(buckets, usable_cores() // 2, 8))


def _warm_isa_checks(cache_root):
    """Inductor's CPU-ISA verdicts, started at once in this process (a thread, overlapping the
    model's load and the workers' start) and stored: a worker that reaches its C++ build reads them
    or waits for the check under way, instead of running its own ~11 probe children; the ISAs'
    check chains run side by side (`compile/isa.py`)."""
    import threading

    from boundgen.compile.isa import warm_isa_checks

    thread = threading.Thread(
        target=warm_isa_checks, args=(cache_root,), name="boundgen-isa-checks", daemon=True
    )
    thread.start()
    return thread


def _eager_config(args):
    """The engine options of this command, backend eager: it builds artifacts, it must not load
    them through `backend=auto`."""
    import dataclasses

    return dataclasses.replace(_engine_config(args), backend="eager")


def _engine_config(args):
    """The engine options: the `--config` file's engine settings (if given), flags over them; the
    same reading as `boundgen serve`'s, so the artifacts are the ones its server looks up."""
    from boundgen.config import EngineConfig
    from boundgen.settings import from_args

    base = None
    if getattr(args, "config", None):
        from boundgen.server.config import load_settings

        base = load_settings(args.config).engine
    return from_args(EngineConfig, args, base)


def _load_eager(model_dir, cfg):
    """The plain model, as `cfg` says (the FP8 gate runs here for an FP8 policy)."""
    from boundgen import Engine

    return Engine.from_pretrained(model_dir, config=cfg)


def _fp8_policy(cfg) -> str:
    """The FP8 policy the model runs, by its canonical name: the same label `Engine` looks its
    artifacts up with (`--fp8`, as for `boundgen serve`)."""
    from boundgen.quant.policy import parse_policy

    return parse_policy(cfg.fp8).name


def _plan(args):
    """The planned buckets (printed with their predicted padding), or None without a profile."""
    from boundgen.compile import planner

    if args.profile and args.from_traffic:
        raise ValueError("give --profile or --from-traffic, not both")
    if args.buckets:
        raise ValueError("give --buckets or a profile to plan them from, not both")
    if args.profile:
        entries = planner.load_profile(args.profile)
    else:
        entries = planner.load_traffic(args.from_traffic)
    budget = _engine_config(args).max_batch_tokens
    plan = planner.plan(entries, budget, args.max_bucket_tokens, args.max_cascade_buckets)
    print(plan.report())
    return plan.buckets


def _check(model_dir, cfg, quant: str, buckets, cache) -> int:
    """--check: hit / missing / stale / corrupt per bucket (exit 1 unless all hit)."""
    from boundgen.compile.backends import aoti_slots
    from boundgen.compile.cache import ArtifactError, platform_info

    engine = _load_eager(model_dir, cfg)
    plat = platform_info(engine.device)
    rows = []
    for b, slot in zip(buckets, aoti_slots(engine.model, engine.device, buckets, quant)):
        try:
            cache.lookup(slot, plat)
            rows.append({"bucket": b.name, "event": "hit"})
        except ArtifactError as exc:
            rows.append({"bucket": b.name, "event": exc.kind, "reason": str(exc)})
    print(_table(rows))
    for r in rows:
        if r.get("reason"):
            print(f"  {r['bucket']}: {r['reason']}")
    return 0 if all(r["event"] == "hit" for r in rows) else 1


def _build_here(engine, bucket, cache, quant: str) -> dict:
    """One bucket built in this process: its info row, or `failed`'s row."""
    from boundgen.compile.backends import build_aoti
    from boundgen.compile.parallel import failed

    try:
        ((_, _, info),) = build_aoti(engine.model, engine.device, [bucket], cache, quant, True)
    except Exception as exc:
        return failed(bucket.name, exc)
    return info


def _failure(row: dict) -> str:
    """A failed build as the command prints it: the error, then its traceback's last lines."""
    tail = "".join(f"\n      {line}" for line in row.get("traceback", [])[-6:])
    return row["error"] + tail


def _start_workers(args, cfg, quant: str, buckets, cache, jobs: int):
    """The parallel build, started before this process loads its own model (the workers' start
    overlaps it). Workers verify their bucket themselves when they can start with the libstdc++
    preload that makes loading safe (`compile.preload.child_preload`)."""
    import torch  # noqa: F401 - maps this process's libstdc++, which child_preload looks at

    from boundgen.compile.parallel import ParallelBuild
    from boundgen.compile.preload import child_preload
    from boundgen.models.loading import resolve_device

    safe, preload = child_preload(cache.root)
    return ParallelBuild(
        args.model,
        str(resolve_device(cfg.device)),
        cfg.dtype,
        cfg.attention,
        buckets,
        cache.root,
        quant,
        True,
        jobs,
        fp8_emulate=cfg.fp8_emulate,
        verify=args.verify and safe,
        preload=preload,
    )


def run(args) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from boundgen.compile.backends import aoti_slots
    from boundgen.compile.buckets import parse_buckets
    from boundgen.compile.cache import ArtifactCache

    planned = _plan(args) if args.profile or args.from_traffic else None
    if args.plan_only:
        if planned is None:
            raise ValueError("--plan-only needs --profile or --from-traffic")
        return 0
    if not args.model:
        raise ValueError("--model is required to compile")
    t0 = time.perf_counter()
    cache = ArtifactCache(args.cache_dir)
    cfg = _eager_config(args)
    quant = _fp8_policy(cfg)
    buckets = planned or parse_buckets(args.buckets, cfg.max_batch_tokens)
    if args.check:
        return _check(args.model, cfg, quant, buckets, cache)
    isa = _warm_isa_checks(cache.root)
    engine = None
    if args.force:  # the slots to remove come from the model
        engine = _load_eager(args.model, cfg)
        for slot in aoti_slots(engine.model, engine.device, buckets, quant):
            cache.remove(slot)
    jobs = _jobs(args.jobs, len(buckets))
    workers = None
    if jobs > 1 and len(buckets) > 1:
        workers = _start_workers(args, cfg, quant, buckets, cache, jobs)
    try:
        # the parent's own model: the FP8 gate for the policy, and the fallback verification
        engine = engine or _load_eager(args.model, cfg)
    except BaseException:
        if workers is not None:
            workers.cancel()
        raise
    bar = tqdm(total=len(buckets), desc="compile", unit="bucket", file=sys.stderr)
    load_check = _LoadCheck(cache.root)
    beam_layers = _BeamLayers(engine, cache.root)
    if workers is not None:
        beam_layers.start()

    def done(info: dict) -> None:
        bar.set_postfix_str(f"{info['bucket']} {info['event']}")
        bar.update(1)
        if info.get("error"):  # said when it happens: a run cut short still says why
            retry = " (built again in this process after the others)" if workers else ""
            bar.write(f"  {info['bucket']}: build failed{retry}: {_failure(info)}", file=sys.stderr)
        if info.get("path"):
            load_check.start(info["path"])

    if workers is not None:
        rows = workers.results(on_done=done)
        # a bucket whose worker failed is built once more here, in this process: a compile can
        # fail once and not again (the H200's t16384 W5 bucket, 2026-12-02), and a user should
        # not have to run the whole command again for it
        again = [i for i, r in enumerate(rows) if r["event"] == "error"]
        if again:
            bar.total += len(again)
        for i in again:
            info = _build_here(engine, buckets[i], cache, quant)
            info["first_try"] = rows[i]
            rows[i] = info
            done(info)
    else:
        rows = []
        for b in buckets:
            info = _build_here(engine, b, cache, quant)
            rows.append(info)
            done(info)
    bar.close()
    isa.join()
    if workers is None:
        beam_layers.start()
    for r in rows:
        if r.get("size_bytes"):
            r["size_mb"] = r["size_bytes"] / 1e6
    ok = [(b, Path(r["path"]), r) for b, r in zip(buckets, rows) if r.get("path")]
    diag = load_check.wait()
    notes = [_load_note(diag)] if diag else []
    beams = beam_layers.wait()
    if beams:
        notes.append(beams)
    unverified = [e for e in ok if "max_abs_diff" not in e[2]]
    if args.verify and unverified:
        notes.append(_verify(engine, unverified, cache.root))
    elif args.verify and ok:
        notes.append("verified against eager (in the build workers)")
    note = "; ".join(notes)
    print(_table(rows))
    for r in rows:
        if r.get("first_try"):
            again = "tried again in this process after its build worker failed"
            print(f"  {r['bucket']}: {again}: {_failure(r['first_try'])}")
        if r.get("error"):
            print(f"  {r['bucket']}: {_failure(r)}")
        elif r.get("phases_s") and r.get("event") != "hit":
            top = list(r["phases_s"].items())[:4]
            print(f"  {r['bucket']}: " + ", ".join(f"{k} {v:.1f} s" for k, v in top))
    print(
        f"{len(ok)}/{len(rows)} buckets ready in {cache.root} ({time.perf_counter() - t0:.1f} s)"
        + (f"; {note}" if note else "")
    )
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"rows": rows, "note": note}, indent=1, default=str)
        )
    return 0 if len(ok) == len(rows) else 1
