"""Rowwise FP8 (e4m3) linear layers: weights quantized once at load, activations per token.

`Fp8Linear` keeps `weight` as float8_e4m3fn `[N, K]` with one fp32 scale per output channel
(`weight_scale [1, N]`), quantizes its input per token (`a_scale [M, 1]`) and calls
`torch._scaled_mm(a8, w8.t(), scale_a, scale_b, out_dtype=bf16)`; the bias is added after, in bf16.
In `emulate` mode the same quantized values are multiplied in fp32 on any device (CPU CI, pre-Hopper
GPUs), so tests and the fidelity gate see the numerics of the real kernel. `quantize_modules` is the
pass that swaps named `nn.Linear` modules for it; which ones is the policy's business
(`boundgen.quant.policy`).

NOTE: forward only reads buffers and fixed attributes (mode, act_quant), so
`torch.export`/AOTInductor see plain tensors and `torch._scaled_mm`. The Triton activation quantizer
is used in eager mode only; under torch.compile/export the plain-torch quantizer is traced and
Inductor fuses it with its producer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from boundgen.quant import triton_quant
from boundgen.quant.rowwise import FP8_DTYPE, quantize_rowwise, quantize_weight

MODES = ("scaled_mm", "emulate")
ACT_QUANTS = ("auto", "torch", "triton")


class Fp8NotSupportedError(RuntimeError):
    """Real FP8 was asked for on a device without rowwise FP8 matmul support."""


# -------------------------------------------------------------------------------------------------
# Device support


@functools.cache
def _probe_scaled_mm(device_index: int) -> str | None:
    """Run a tiny rowwise `_scaled_mm`; None if it works, else the error text."""
    try:
        dev = torch.device("cuda", device_index)
        g = torch.Generator(device=dev).manual_seed(0)  # leave the global RNG alone
        a, sa = quantize_rowwise(torch.randn(16, 32, device=dev, generator=g))
        w, sw = quantize_weight(torch.randn(32, 32, device=dev, generator=g))
        out = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)
        ref = (a.float() @ w.float().t()) * sa * sw
        if not torch.allclose(out.float(), ref, rtol=2e-2, atol=1e-2):
            return "rowwise _scaled_mm returned wrong values"
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def fp8_supported(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether `device` runs rowwise FP8 `torch._scaled_mm` (sm_89+), and why (not)."""
    device = torch.device(
        device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    hint = "use emulate=True (--emulate) to check FP8 numerics without FP8 hardware"
    if device.type != "cuda":
        return False, f"FP8 matmul needs an NVIDIA GPU (sm_89+); device is {device.type}; {hint}"
    if not torch.cuda.is_available():
        return False, f"CUDA is not available in this torch build ({torch.__version__}); {hint}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        return False, f"{name} is sm_{major}{minor}; rowwise FP8 needs sm_89+ (Ada/Hopper); {hint}"
    error = _probe_scaled_mm(index)
    if error:
        return (
            False,
            f"torch._scaled_mm rowwise FP8 failed on {name} (sm_{major}{minor}, torch "
            f"{torch.__version__}): {error}; {hint}",
        )
    return True, f"{name} (sm_{major}{minor}): rowwise FP8 via torch._scaled_mm"


# -------------------------------------------------------------------------------------------------
# The layer


def _triton_available(device: torch.device | None = None) -> bool:
    """Triton importable and, on `device`, agreeing with the torch quantizer (checked once)."""
    if not triton_quant.AVAILABLE:
        return False
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return triton_quant.self_test(index) is None
    return True


class Fp8Linear(nn.Module):
    """Drop-in for `nn.Linear` with rowwise FP8 weights and per-token dynamic FP8 activations.

    Buffers: `weight` [N, K] e4m3, `weight_scale` [1, N] fp32, `bias` [N] (original dtype) or None.
    `mode`: "scaled_mm" (Hopper/Ada kernel) or "emulate" (same quantized values, fp32 matmul, any
    device). `act_quant`: "torch" (plain ops; fused by Inductor when compiled) or "triton" (one-pass
    kernels on CUDA: the rowwise quantize in eager runs, the SiLU·mul + quantize of a down
    projection (`silu_mul_forward`) in eager and compiled runs).
    """

    # compiled with Inductor's reductions kept on chip up to 8,192-wide rows: the input quantize's
    # amax is one (`compile.aoti.WIDE_ROW_MAX`); part of the compile cache key
    COMPILE_RECIPE = "wide-row-reductions"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        mode: str = "scaled_mm",
        act_quant: str = "torch",
        out_dtype: torch.dtype = torch.bfloat16,
        device=None,
    ):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown FP8 mode {mode!r}; choose from {MODES}")
        if act_quant not in ("torch", "triton"):
            raise ValueError(f"unknown activation quantizer {act_quant!r}; choose torch or triton")
        if mode == "scaled_mm" and (in_features % 16 or out_features % 16):
            raise ValueError(
                "torch._scaled_mm needs in/out features divisible by 16, got "
                f"{in_features}x{out_features}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.mode = mode
        self.act_quant = act_quant
        self.out_dtype = out_dtype
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device)
        )
        self.register_buffer(
            "weight_scale", torch.ones(1, out_features, dtype=torch.float32, device=device)
        )
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=out_dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        mode: str = "scaled_mm",
        act_quant: str = "torch",
    ) -> Fp8Linear:
        w = linear.weight
        out_dtype = (
            w.dtype if w.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        )
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            mode=mode,
            act_quant=act_quant,
            out_dtype=out_dtype,
            device=w.device,
        )
        w8, scale = quantize_weight(w)
        layer.weight.copy_(w8)
        layer.weight_scale.copy_(scale)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.detach().to(out_dtype))
        return layer

    def _apply(self, fn, recurse=True):
        # NOTE: `model.to(dtype)` / `.half()` must not cast the e4m3 weight or its fp32 scales (a
        # round trip through bf16 would lose scale bits); device moves still apply. The bias
        # follows the model.
        keep = {k: self._buffers[k] for k in ("weight", "weight_scale")}
        super()._apply(fn, recurse)
        for k, old in keep.items():
            new = self._buffers[k]
            if new.dtype != old.dtype:
                self._buffers[k] = old.to(new.device)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, mode={self.mode}, act_quant={self.act_quant}"
        )

    def _quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.act_quant == "triton" and x2.is_cuda and not torch.compiler.is_compiling():
            return triton_quant.quantize_rowwise_triton(x2)
        return quantize_rowwise(x2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        a8, a_scale = self._quantize_input(x.reshape(-1, self.in_features))
        return self._project(a8, a_scale, x.shape[:-1], x.dtype)

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """This projection of SiLU(gate)·up, gate_up [..., 2K] = [gate | up] (a gated MLP's down
        projection: `models.layers.GatedMLP` hands it the gate_up output). With act_quant "triton"
        on CUDA the SiLU·mul and the input quantize are one kernel, eagerly and inside a compiled
        graph (`triton_quant.silu_mul_quant`); else eager's ops, which Inductor fuses."""
        if self.act_quant == "triton" and gate_up.is_cuda:
            a8, a_scale = torch.ops.boundgen.silu_mul_quant(
                gate_up.reshape(-1, 2 * self.in_features)
            )
            return self._project(a8, a_scale, gate_up.shape[:-1], gate_up.dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        return self(nn.functional.silu(gate) * up)

    @property
    def compile_variant(self) -> str:
        """What this instance changes in a compiled graph (part of the compile cache key): the
        fused SiLU·mul quantize op with act_quant "triton" (on CUDA) and its tiles
        (`triton_quant.TILES`), plain ops otherwise."""
        if self.act_quant != "triton":
            return ""
        tile = triton_quant.TILES.get(self.in_features)
        return "silu-mul-quant" + (f":{tile[0]}x{tile[1]}" if tile else "")

    def _project(
        self, a8: torch.Tensor, a_scale: torch.Tensor, lead: torch.Size, dtype: torch.dtype
    ) -> torch.Tensor:
        """a8 [M, K] e4m3, a_scale [M, 1] fp32 → [*lead, N] in `dtype` (the input's)."""
        if self.mode == "scaled_mm":
            # NOTE: rowwise scaling only supports a bf16 output; other model dtypes are cast after.
            y = torch._scaled_mm(
                a8,
                self.weight.t(),
                scale_a=a_scale,
                scale_b=self.weight_scale,
                out_dtype=torch.bfloat16,
            )
        else:
            # e4m3 x e4m3 products are exact in fp32; accumulate in fp32, scale in fp32 (as the
            # kernel does). The kernel writes bf16: round there too, so emulation matches it in
            # every model dtype.
            y = ((a8.float() @ self.weight.float().t()) * a_scale * self.weight_scale).to(
                torch.bfloat16
            )
        if dtype != torch.bfloat16:  # output in the input's dtype, like nn.Linear
            y = y.to(dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


# -------------------------------------------------------------------------------------------------
# The pass


def model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def resolve_mode(device: torch.device | str, emulate: bool) -> str:
    """ "emulate" if asked, else "scaled_mm" if the device supports it, else a clear error."""
    if emulate:
        return "emulate"
    ok, reason = fp8_supported(device)
    if not ok:
        raise Fp8NotSupportedError(f"real FP8 is not available: {reason}")
    return "scaled_mm"


def resolve_act_quant(act_quant: str, device: torch.device) -> str:
    if act_quant not in ACT_QUANTS:
        raise ValueError(f"unknown activation quantizer {act_quant!r}; choose from {ACT_QUANTS}")
    if act_quant == "auto":
        # Measured choice: see docs/fp8.md. Triton only pays in eager mode on CUDA.
        return "triton" if device.type == "cuda" and _triton_available(device) else "torch"
    if act_quant == "triton" and not _triton_available(device):
        raise RuntimeError(
            "act_quant='triton' needs the triton package (CUDA builds of torch ship it)"
        )
    return act_quant


def quantize_modules(
    model: nn.Module, names: list[str], *, emulate: bool = False, act_quant: str = "auto"
) -> nn.Module:
    """Swap the named `nn.Linear` modules for `Fp8Linear` in place; returns `model`.

    Raises `Fp8NotSupportedError` when real FP8 is asked for on a device that lacks it (pass
    `emulate=True` for quantize→dequantize numerics on any device).
    """
    if not names:
        return model
    device = model_device(model)
    mode = resolve_mode(device, emulate)
    aq = resolve_act_quant(act_quant, device)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if type(linear) is not nn.Linear:
            raise TypeError(f"{name} is {type(linear).__name__}, not nn.Linear")
        setattr(parent, child, Fp8Linear.from_linear(linear, mode=mode, act_quant=aq))
        del linear
    return model


@contextlib.contextmanager
def fp8_swapped(
    model: nn.Module, names: list[str], *, emulate: bool = False, act_quant: str = "auto"
) -> Iterator[nn.Module]:
    """`quantize_modules` for the length of a `with` block, then the original `nn.Linear` modules
    come back: one loaded bf16 model serves the gate's reference and every candidate."""
    originals = {name: model.get_submodule(name) for name in names}
    try:
        yield quantize_modules(model, names, emulate=emulate, act_quant=act_quant)
    finally:
        for name, linear in originals.items():
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, linear)


def fp8_modules(model: nn.Module) -> list[str]:
    """Names of the Fp8Linear modules in `model` (what a policy actually swapped)."""
    return [name for name, m in model.named_modules() if isinstance(m, Fp8Linear)]
