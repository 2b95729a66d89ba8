"""The one-kernel decoder layer (`models/layer_kernel.py`) against the model's own layers.

Without CUDA the kernel's steps run one launch each in Triton's CPU interpreter (conftest.py sets
`TRITON_INTERPRET=1`, `triton_launch.interpreted()` lets CPU tensors in); the barriers between
them run only on the GPU (`gpu` tests); the kernel is compiled for sm_90 without one in
test_sm90_layer_kernel.py.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from small_layer import small_config, spread_weights

pytest.importorskip("triton")

from boundgen import triton_launch
from boundgen.models import layer_kernel
from boundgen.models.decoder import DecoderModel
from boundgen.quant.fp8 import Fp8Linear
from boundgen.text.packing import SequenceGroup, pack

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"

# The smallest shapes the kernel takes: a hidden size of two 64-column tiles, heads of 64, an
# intermediate size of two 32-column tiles; two layers, so the second reads the first's squares.
SMALL = dict(
    hidden_size=128, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=64, num_layers=2
)


def _model(dtype, **kw) -> DecoderModel:
    torch.manual_seed(0)
    model = DecoderModel(small_config(**{**SMALL, **kw})).eval().requires_grad_(False)
    spread_weights(model, 0.05, 0.1)
    model = model.to(DEV, dtype)
    model.rotary.reset()
    return model


def _batch(lengths):
    ids = torch.arange(sum(lengths)) % 120 + 1
    prompts, at = [], 0
    for n in lengths:
        prompts.append(ids[at : at + n].tolist())
        at += n
    return pack([SequenceGroup([], prompts)], share_prefix=False).to(DEV)


def _both(model, batch):
    """The model's hidden states through its own layers and through the kernel."""
    args = (batch.input_ids, batch.positions, batch.attn)
    want = model(*args)
    with triton_launch.interpreted(), layer_kernel.rows_up_to(64):
        x = model.embed_tokens(batch.input_ids)
        assert layer_kernel.applies(model, x, batch.attn, None)
        got = model(*args)
    return got, want


@pytest.mark.parametrize(
    "lengths",
    # one prompt; packed prompts whose attention must not cross; one token; a full 64-row tile
    [[7], [4, 6, 3], [1], [40, 24]],
)
def test_the_kernel_computes_the_layers_in_float32(lengths):
    # float32: only the summation order differs (and the norm's rounding points, exact here)
    got, want = _both(_model(torch.float32), _batch(lengths))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("flow", [0, 1])
@pytest.mark.parametrize("splits", [(1, 1, 1, 1), (7, 7, 2, 9), (2, 1, 2, 1)])
def test_the_kernel_computes_the_layers_with_its_k_cut_or_not(monkeypatch, splits, flow):
    # one slice: the products' epilogue at once; more: partials summed by the last to arrive.
    # FLOW: every wait finds its count complete (else the op raises: each step's launch here
    # runs after the steps before, what the GPU's one launch waits for)
    for name, n in zip(("QKV_SPLITS", "O_SPLITS", "GATED_SPLITS", "DOWN_SPLITS"), splits):
        monkeypatch.setattr(layer_kernel, name, n)
    monkeypatch.setattr(layer_kernel, "FLOW", flow)
    got, want = _both(_model(torch.float32), _batch([4, 6, 3]))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("flow", [0, 1])
@pytest.mark.parametrize("layers", [2, 4])
def test_every_layer_in_one_launch_computes_the_layers(monkeypatch, flow, layers):
    # STACK: the first layer's weights and the others' offsets from them; the layers between the
    # first and the last pass their output on through two buffers in turn (4 layers: both
    # reused); FLOW's counts grow over the layers (each wait checked against its layer's need)
    monkeypatch.setattr(layer_kernel, "STACK", 1)
    monkeypatch.setattr(layer_kernel, "FLOW", flow)
    model = _model(torch.float32, num_layers=layers)
    seen = []
    real = layer_kernel.stack_offsets
    monkeypatch.setattr(layer_kernel, "stack_offsets", lambda m: seen.append(real(m)) or seen[-1])
    got, want = _both(model, _batch([4, 6, 3]))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert seen and seen[0] is not None and tuple(seen[0].shape) == (layers, 7)  # one op call


def test_the_offsets_are_made_once_and_refused_off_the_16_element_grid():
    model = _model(torch.float32, num_layers=3)
    offsets = layer_kernel.stack_offsets(model)
    assert offsets.dtype == torch.int64 and tuple(offsets.shape) == (3, 7)
    assert offsets[0].tolist() == [0] * 7
    assert layer_kernel.stack_offsets(model) is offsets  # cached while the weights stay put
    # a layer's weight as a view 3 elements into a buffer: no whole 16-element distance
    norm = model.layers[1].input_layernorm
    moved = torch.zeros(norm.weight.numel() + 3, dtype=norm.weight.dtype, device=DEV)[3:]
    norm.weight = torch.nn.Parameter(moved.copy_(norm.weight.detach()), requires_grad=False)
    assert layer_kernel.stack_offsets(model) is None
    # and the forward then takes a launch a layer, still right
    with mock.patch.object(layer_kernel, "STACK", 1):
        got, want = _both(model, _batch([5]))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # the unwritten scratch it reads
def test_flows_counts_are_checked(monkeypatch):
    # a step launched without the steps before: its FLOW waits find their counts short, which
    # the interpreter's launch counts and the op raises on (the check is not vacuous)
    monkeypatch.setattr(layer_kernel, "FLOW", 1)
    monkeypatch.setattr(layer_kernel, "STEPS", (3,))
    model = _model(torch.float32)
    with pytest.raises(RuntimeError, match="FLOW waits"):
        _both(model, _batch([6]))


@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_computes_the_layers_in_bf16(bias):
    # bf16: GEMMs rounded once with their bias, residual sums rounded once (eager rounds the
    # GEMM's output first): a few units in the last place after two layers
    got, want = _both(_model(torch.bfloat16, qkv_bias=bias), _batch([5, 9]))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=6e-2)


@pytest.mark.parametrize("stack", [0, 1])
@pytest.mark.parametrize("flow", [0, 1])
def test_every_call_leaves_its_counters_at_zero(monkeypatch, flow, stack):
    # the down step's per-tile counters (and on the GPU the barriers', with FLOW its counts)
    # serve every layer of a forward: a call that left one set would make the next layer's last
    # slice sum, or a FLOW wait end, too early
    monkeypatch.setattr(layer_kernel, "FLOW", flow)
    model = _model(torch.float32)
    batch = _batch([6])
    with triton_launch.interpreted(), layer_kernel.rows_up_to(64), torch.no_grad():
        x = model.embed_tokens(batch.input_ids)
        cos, sin = model.rotary(batch.positions, x.dtype)
        cos, sin, squares, counters = layer_kernel.first_inputs(model, x, cos, sin)
        offsets = layer_kernel.stack_offsets(model) if stack else None  # every layer, one op
        args = layer_kernel.op_args(
            model.layers[0], x, squares, cos, sin, batch.attn.cu_seqlens, counters, offsets
        )
        torch.ops.boundgen.fused_layers(*args)
    assert counters.tolist() == [0] * len(counters)
    # every layer's norm sums a fixed count of tiles (unrolled): the first layer's sums come in
    # that layout, and another is refused before the kernel could read past it
    assert squares.shape == (SMALL["hidden_size"] // layer_kernel.HIDDEN_TILE, layer_kernel.LIMIT)
    with triton_launch.interpreted(), pytest.raises(ValueError, match="squares"):
        torch.ops.boundgen.fused_layers(*args[:1], squares[:1], *args[2:])


def test_off_by_default_and_only_for_the_forwards_it_has():
    model = _model(torch.float32)
    batch = _batch([5])
    with triton_launch.interpreted():
        x = model.embed_tokens(batch.input_ids)
        assert not layer_kernel.applies(model, x, batch.attn, None)  # MAX_ROWS 0
        with layer_kernel.rows_up_to(64):
            assert layer_kernel.applies(model, x, batch.attn, None)
            assert not layer_kernel.applies(model, x, batch.attn, kv=object())  # a KV to store
        with layer_kernel.rows_up_to(4):
            assert not layer_kernel.applies(model, x, batch.attn, None)  # 5 rows > 4
        with layer_kernel.rows_up_to(64), mock.patch("torch.compiler.is_compiling", lambda: True):
            assert not layer_kernel.applies(model, x, batch.attn, None)  # traced: not yet
            with mock.patch.object(layer_kernel, "TRACED", True):  # the bench's diagnosis
                assert layer_kernel.applies(model, x, batch.attn, None)
        with layer_kernel.rows_up_to(128):  # past one program's tile
            long = torch.zeros(65, x.shape[1], dtype=x.dtype, device=DEV)
            assert not layer_kernel.applies(model, long, batch.attn, None)
    shared = pack([SequenceGroup([1, 2, 3], [[4, 5], [6, 7]])], share_prefix=True).to(DEV)
    with triton_launch.interpreted(), layer_kernel.rows_up_to(64):
        assert shared.attn.has_shared_prefix
        assert not layer_kernel.applies(model, x, shared.attn, None)
        model.layers[0].mlp.down_proj = Fp8Linear.from_linear(model.layers[0].mlp.down_proj)
        assert not layer_kernel.applies(model, x, batch.attn, None)


@pytest.mark.gpu
@pytest.mark.parametrize("stack", [0, 1])
@pytest.mark.parametrize("flow", [0, 1])
@pytest.mark.parametrize("lengths", [[64], [20, 30, 14], [3]])
def test_the_kernel_matches_the_models_layers_on_the_gpu(monkeypatch, lengths, flow, stack):
    """Qwen2.5-0.5B's layer shape, 4 layers, bf16: the kernel's forward (launched cooperatively,
    with its barriers or FLOW's waits, whose order only the GPU's concurrent programs test; a
    launch a layer, or with `stack` all 4 in one) against the model's own eager layers, within
    bf16 noise, and again (the counters it left are zero)."""
    monkeypatch.setattr(layer_kernel, "FLOW", flow)
    monkeypatch.setattr(layer_kernel, "STACK", stack)
    model = _gpu_model()
    batch = _batch(lengths)
    args = (batch.input_ids, batch.positions, batch.attn)
    want = model(*args)
    with layer_kernel.rows_up_to(64):
        got = model(*args)
        again = model(*args)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=6e-2)
    assert torch.equal(got, again)


@pytest.mark.gpu
@pytest.mark.parametrize("stack", [0, 1])
def test_the_kernel_replays_from_a_cuda_graph(monkeypatch, stack):
    """The `eager+graphs` backend's path: the forward with the kernel captured as one CUDA graph
    (its cooperative launches and its counters' zeroing inside; with `stack` one launch of
    every layer, its offsets made before the capture) replays what it computes eagerly,
    twice."""
    monkeypatch.setattr(layer_kernel, "STACK", stack)
    model = _gpu_model()
    batch = _batch([40, 24])
    args = (batch.input_ids, batch.positions, batch.attn)
    with layer_kernel.rows_up_to(64):
        want = model(*args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(*args)  # warmed up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(*args)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def _gpu_model() -> DecoderModel:
    """Qwen2.5-0.5B's layer shape, 4 layers, bf16, random weights."""
    torch.manual_seed(0)
    cfg = small_config(
        hidden_size=896, intermediate_size=4864, num_heads=14, num_kv_heads=2, head_dim=64,
        num_layers=4, vocab_size=512,
    )  # fmt: skip
    model = DecoderModel(cfg).eval().requires_grad_(False)
    spread_weights(model, 0.02, 0.1)
    model = model.to("cuda", torch.bfloat16)
    model.rotary.reset()
    return model
