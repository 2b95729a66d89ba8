"""Issue 25 (W3) and 24 (few-row layers): each decoder layer of a short prompt as one persistent
kernel (`models/layer_kernel.py`) against the layers the engine compiles today, on the GPU.

    python benchmarks/bench_layer_kernel.py --out $OUT/layer_kernel.json     # H100/H200, ~3-4 min

A Qwen2.5-0.5B-shaped model (24 layers, random weights ~N(0, 0.02), a small vocabulary: the head is
not part of it) compiled as the engine compiles a prefill bucket (`torch.compile` of
`PackedForward`, the streamed few-row kernels, programmatic edges for buckets of ≤ 128 tokens), with
and without `BOUNDGEN_LAYER_KERNEL_MAX_ROWS` (traced apart), and the eager forward with it (what the
`eager+graphs` backend runs: the engine takes the kernel in eager forwards only), each forward
captured as one CUDA graph. Per batch layout (`--layouts`: one 64-token prompt is W3's), the sides'
graphs replayed alternately (`--rounds` × `--replays`), median µs a forward and a layer; each side's
output against the eager model's (max |diff|, bf16), and the kernel's from two calls (equal: the
counters it left are zero). `--profile`: a kernel table of one replay a side. `--steps`: each of the
kernel's steps launched alone (W3's prompt), µs a layer, for its tiles and any `--configs`;
`--diagnose`: the traced forward against the eager one on 2 layers, with Inductor's code of it.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_info, kernel_table, write_json

from boundgen import grid_dependency
from boundgen.checkpoints import hf_config
from boundgen.compile import programmatic
from boundgen.compile.aoti import PackedForward
from boundgen.config import ModelConfig
from boundgen.models import layer_kernel
from boundgen.models.decoder import DecoderModel
from boundgen.settings import switched
from boundgen.text.packing import SequenceGroup, pack

LAYOUTS = {"w3": [64], "packed": [20, 30, 14], "16": [16], "32": [32]}


def w3_batch(device):
    return pack([SequenceGroup([], [[(j % 1000) + 1 for j in range(64)]])]).to(device)


def build_model(device, layers: int = 24, preset: str = "qwen2.5-0.5b") -> DecoderModel:
    """A model of `preset`'s layer shape (`checkpoints.PRESETS`), `layers` of them, random
    weights."""
    hf = {**hf_config(preset), "num_hidden_layers": layers, "vocab_size": 1024}  # no head timed
    cfg = ModelConfig.from_hf(hf)
    torch.manual_seed(0)
    model = DecoderModel(cfg).eval().requires_grad_(False)
    for p in model.parameters():
        if p.dim() == 1:
            torch.nn.init.normal_(p, mean=1.0, std=0.1)
        else:
            torch.nn.init.normal_(p, std=0.02)
    model = model.to(device, torch.bfloat16)
    model.rotary.reset()
    return model


def graphed(fn, tokens: int) -> torch.cuda.CUDAGraph:
    """`fn` warmed up and captured as the engine captures a small bucket's forward."""
    with grid_dependency.for_bucket(tokens):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        with programmatic.capture() as graph:
            fn()
    return graph


def time_sides(graphs: dict, rounds: int, replays: int) -> dict:
    times = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, graph in graphs.items():
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / replays)
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


@contextlib.contextmanager
def knobs(config: str):
    """Inside: `layer_kernel`'s tile knobs set as `config` says ("default": as they are; fewer
    values than knobs: the first ones, the rest as they are, so an older command line still
    reads as it did)."""
    values = [] if config == "default" else [int(v) for v in config.split(":")]
    if len(values) > len(layer_kernel.KNOBS):
        raise ValueError(f"{config}: at most {len(layer_kernel.KNOBS)} values")
    with contextlib.ExitStack() as stack:
        for name, value in zip(layer_kernel.KNOBS, values):
            stack.enter_context(switched(vars(layer_kernel), name, value))
        yield


def time_steps(model, batch, rounds: int, replays: int) -> dict:
    """Each step of the kernel (`PHASE`) launched alone over every layer's weights, one graph a
    step, and all steps with the barriers: µs a layer, where a layer's time goes (timing only:
    a step launched alone reads the scratch its step before would have written, uninitialised,
    and each layer reads the embedded tokens)."""
    x = model.embed_tokens(batch.input_ids)
    cos, sin = model.rotary(batch.positions, x.dtype)
    cos, sin, squares, counters = layer_kernel.first_inputs(model, x, cos, sin)
    layers = model.config.num_layers
    # the forward's op calls (`STACK`: one for every layer)
    args = [
        layer_kernel.op_args(layer, x, squares, cos, sin, batch.attn.cu_seqlens, counters, offs)
        for layer, offs in layer_kernel.launches(model)
    ]
    graphs = {}
    for name, steps in [("all", (-1,)), *((f"step{k}", (k,)) for k in range(5))]:

        def run():
            for a in args:
                torch.ops.boundgen.fused_layers(*a)

        with switched(vars(layer_kernel), "STEPS", steps):
            graphs[name] = graphed(run, batch.num_tokens)
    us = time_sides(graphs, rounds, replays)
    return {name: round(v / layers, 2) for name, v in us.items()}


def diagnose(model, batch, out_dir: str | None) -> dict:
    """The compiled forward with the kernel against the eager one with it, and what torch's
    analysis takes the kernel to write (torch 2.11: `identify_mutated_tensors`); Inductor's code
    of the compiled forward written to `out_dir` (layer_kernel_code.py)."""
    import torch._higher_order_ops.triton_kernel_wrap as wrap
    from torch._inductor.utils import run_and_get_code

    inputs = (batch.input_ids, batch.positions, batch.attn)
    found = {}
    real = layer_kernel.traceable

    def spy(kernel):
        wrapped = real(kernel)

        class Grid:
            def __getitem__(self, grid):
                def call(*a, **kw):
                    names = kernel.arg_names
                    kwargs = {**dict(zip(names, a)), **kw}
                    launch_only = ("num_warps", "num_stages")
                    kwargs = {k: v for k, v in kwargs.items() if k not in launch_only}
                    try:
                        if hasattr(wrap, "identify_accessed_tensors"):
                            acc = wrap.identify_accessed_tensors(kernel, kwargs, {})
                            found["written"] = sorted(d.name for d in acc.read_writes.writes)
                        else:
                            found["written"] = sorted(
                                wrap.identify_mutated_tensors(kernel, kwargs, {})
                            )
                    except Exception as e:  # the analysis' own failure is the finding
                        found["written"] = f"{type(e).__name__}: {e}"
                    return wrapped[grid](*a, **kw)

                return call

        return Grid()

    with torch.inference_mode(), layer_kernel.rows_up_to(layer_kernel.LIMIT):
        layer_kernel.traceable = spy
        try:
            eager = model(*inputs)
        finally:
            layer_kernel.traceable = real
        compiled = torch.compile(PackedForward(model), fullgraph=True, dynamic=False)
        got, codes = run_and_get_code(compiled, *inputs)
    plain = model(*inputs)
    if out_dir:
        Path(out_dir, "layer_kernel_code.py").write_text("\n\n# ----\n\n".join(codes))
    return {
        "written_by_the_analysis": found.get("written"),
        "eager_kernel_vs_plain": (eager.float() - plain.float()).abs().max().item(),
        "compiled_kernel_vs_plain": (got.float() - plain.float()).abs().max().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="*", default=["w3", "packed", "16"], choices=list(LAYOUTS))
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="a kernel table a side (first layout)")
    ap.add_argument("--steps", action="store_true", help="each step alone (w3), µs a layer")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=[],
        help="with --steps, tiles to time beside the default's: each the values of "
        "layer_kernel.KNOBS joined by ':' (BLOCK_K:INTER_TILE:QKV_SPLITS:O_SPLITS:GATED_SPLITS:"
        "DOWN_SPLITS:NUM_WARPS:NUM_STAGES:PREFETCH:FLOW:STACK; fewer values set the first "
        "knobs, the rest stay; 64:32:1:1:1:9:4:3:0:0 is the first version)",
    )
    ap.add_argument("--diagnose", action="store_true", help="compiled against eager (2 layers)")
    ap.add_argument(
        "--sides",
        nargs="+",
        default=["layers", "kernel", "kernel-eager"],
        choices=["layers", "kernel", "kernel-eager"],
        help="the forwards timed per layout (`layers` first: the others' speedups are over it)",
    )
    ap.add_argument(
        "--knobs",
        nargs="+",
        default=["default"],
        help="the eager kernel side's tile configurations per layout (as --configs), each a side",
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    layer_kernel.TRACED = True  # the compiled sides trace the kernel (its known failure: see there)
    device = torch.device("cuda")
    model = build_model(device)
    results = {"env": env_info(), "sms": layer_kernel.programs(device), "layouts": {}}
    if args.diagnose:
        small = build_model(device, layers=2)
        try:
            results["diagnose"] = diagnose(
                small, w3_batch(device), str(Path(args.out).parent) if args.out else None
            )
        except Exception as e:  # a failed trace is the finding; the timings still run
            traceback.print_exc()
            results["diagnose"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        print("diagnose:", results["diagnose"])
    if args.steps:
        results["steps_us_a_layer"] = {}
        for config in ["default", *args.configs]:
            with torch.inference_mode(), knobs(config):
                us = time_steps(model, w3_batch(device), args.rounds, args.replays)
            results["steps_us_a_layer"][config] = us
            print(f"steps, {config} (µs a layer):", us)
    layers = model.config.num_layers
    forward = PackedForward(model)
    # side → (rows up to which the kernel takes a forward, the forward, its tile knobs): the
    # compiled layers (what W3 runs today), the kernel traced by torch.compile (wrong so far: see
    # the module), and the kernel in the eager forward (what the `eager+graphs` backend would
    # run) once per `--knobs` configuration, captured with its knobs. One compiled function a
    # side: the switch is read when a forward traces.
    sides = {}
    if "layers" in args.sides:
        sides["layers"] = (0, torch.compile(forward, fullgraph=True, dynamic=False), "default")
    if "kernel" in args.sides:
        traced = torch.compile(forward, fullgraph=True, dynamic=False)
        sides["kernel"] = (layer_kernel.LIMIT, traced, "default")
    if "kernel-eager" in args.sides:
        for config in args.knobs:
            side = "kernel-eager" if config == "default" else f"kernel-eager {config}"
            sides[side] = (layer_kernel.LIMIT, forward, config)
    for name in args.layouts:
        lengths = LAYOUTS[name]
        prompts = [[(i * 7 + j) % 1000 + 1 for j in range(n)] for i, n in enumerate(lengths)]
        batch = pack([SequenceGroup([], prompts)], share_prefix=False).to(device)
        inputs = (batch.input_ids, batch.positions, batch.attn)
        tokens = batch.num_tokens
        with torch.inference_mode():
            want = model(*inputs).float()
            outs, graphs, diffs = {}, {}, {}
            for side, (rows, fn, config) in sides.items():
                with (
                    layer_kernel.rows_up_to(rows),
                    grid_dependency.for_bucket(tokens),
                    knobs(config),
                ):
                    outs[side] = fn(*inputs)
                    again = fn(*inputs)
                    graphs[side] = graphed(lambda fn=fn: fn(*inputs), tokens)
                diffs[side] = {
                    "max_abs_diff_vs_eager": (outs[side].float() - want).abs().max().item(),
                    "repeat_equal": bool(torch.equal(outs[side], again)),
                }
            torch.cuda.synchronize()
        us = time_sides(graphs, args.rounds, args.replays)
        row = {
            "tokens": tokens,
            "lengths": lengths,
            "us_a_forward": us,
            "us_a_layer": {k: round(v / layers, 2) for k, v in us.items()},
            "checks": diffs,
            "speedup": (
                {k: round(us["layers"] / v, 3) for k, v in us.items() if k != "layers"}
                if "layers" in us
                else {}
            ),
        }
        print(f"{name} {lengths}: {row['us_a_forward']} µs a forward; {diffs}")
        if args.profile and name == args.layouts[0]:
            row["kernels"] = {side: kernel_table(graphs[side].replay, top=12) for side in graphs}
            for side, table in row["kernels"].items():
                print(f"-- {side}: busy {table['gpu_busy_ms']} ms, {table['launches']} launches")
                for k in table["kernels"]:
                    print(f"   {k}")
        results["layouts"][name] = row
    write_json(args.out, results)


if __name__ == "__main__":
    main()
