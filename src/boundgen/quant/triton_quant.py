"""One-pass per-token FP8 activation quantizers (Triton).

`quantize_rowwise_triton`, for eager CUDA runs: plain torch needs ~5 kernels (abs, amax, div,
clamp, cast) and several passes over the [M, K] bf16 activation; this kernel reads each row once
and writes e4m3 + one fp32 scale. Under torch.compile/export `Fp8Linear` uses the plain-torch
quantizer instead, which Inductor fuses with the op producing the input.

`silu_mul_quant` (`boundgen::silu_mul_quant`, a `torch.library.triton_op`, so it also runs inside
torch.compile and AOTInductor packages): the MLP's SiLU(gate)·up and the down projection's input
quantize in one pass over the gate_up rows. Inductor fuses the two too, but its rowwise amax over
a 4,864-wide row was a two-pass reduction that cost 16.5 ms of a W1 call on the H200 against 7.9 ms
for bf16's SiLU·mul alone (BENCHMARKS.md, 2026-12-02): this kernel keeps the row on chip.

Numerics match `boundgen.quant.rowwise.quantize_rowwise` (same expressions for amax, scale and the
reciprocal, clamp, round-to-nearest-even cast) applied to eager's SiLU·mul (rounded to the input
dtype after the SiLU and after the product, as eager's two ops round).
"""

from __future__ import annotations

import functools

import torch

from boundgen.quant.rowwise import FP8_DTYPE, FP8_MAX, SCALE_EPS, quantize_rowwise
from boundgen.triton_launch import traceable

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:
    AVAILABLE = False

if AVAILABLE:

    @triton.jit
    def _quantize_store(x, amax, q_row, cols, mask, FP8_MAX_C: tl.constexpr):
        """x (fp32) as e4m3 at q_row[cols], the row's max-abs `amax` mapped to ±FP8_MAX_C."""
        q = x * (FP8_MAX_C / amax)
        q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
        tl.store(q_row + cols, q.to(q_row.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _store_row(x, q_row, s_row, cols, mask, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr):
        """One row x (fp32) as e4m3 at q_row[cols] and its scale at s_row: the max-abs element
        maps to ±FP8_MAX_C (`rowwise.quantize_rowwise`'s expressions)."""
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), EPS * FP8_MAX_C)
        _quantize_store(x, amax, q_row, cols, mask, FP8_MAX_C)
        tl.store(s_row, amax * (1.0 / FP8_MAX_C))

    @triton.jit
    def _silu_mul(base, cols, mask, K):
        """SiLU(gate)·up at `cols` of one gate_up row (gate = base[:K], up = base[K:2K]) in fp32,
        rounded to the input dtype after the SiLU and after the product, as eager's two ops
        round."""
        dtype = base.dtype.element_ty
        gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + K + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return (act * up).to(dtype).to(tl.float32)

    @triton.jit
    def _quant_rows_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        K,
        stride_x,
        stride_q,
        BLOCK: tl.constexpr,
        FP8_MAX_C: tl.constexpr,
        EPS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        _store_row(x, q_ptr + row * stride_q, s_ptr + row, cols, mask, FP8_MAX_C, EPS)

    @triton.jit
    def _chunk_peak(base, offs, start, K, peak):
        cols = start + offs
        return tl.maximum(peak, tl.abs(_silu_mul(base, cols, cols < K, K)))

    @triton.jit
    def _chunk_store(base, q_row, offs, start, K, amax, FP8_MAX_C: tl.constexpr):
        cols = start + offs
        mask = cols < K
        _quantize_store(_silu_mul(base, cols, mask, K), amax, q_row, cols, mask, FP8_MAX_C)

    @triton.jit
    def _piece(base, start, K, SIZE: tl.constexpr):
        """Columns [start, start + SIZE) of one gate_up row: (cols, mask, SiLU(gate)·up)."""
        cols = start + tl.arange(0, SIZE)
        mask = cols < K
        return cols, mask, _silu_mul(base, cols, mask, K)

    @triton.jit
    def _silu_mul_quant_kernel(
        gu_ptr,
        q_ptr,
        s_ptr,
        K,
        stride_gu,
        stride_q,
        BLOCK: tl.constexpr,
        FP8_MAX_C: tl.constexpr,
        EPS: tl.constexpr,
        CHUNKED: tl.constexpr,
        INTERPRET: tl.constexpr,
        P1: tl.constexpr = 0,
        P2: tl.constexpr = 0,
        P3: tl.constexpr = 0,
    ):
        # one row per program. Whole (BLOCK >= K): the row in registers, one read of it. CHUNKED:
        # by BLOCK-wide pieces, the max-abs over the row first, then each piece again (from L2)
        # to quantize: fewer registers a program, so more rows in flight per SM, and no masked
        # lanes beyond the last piece. P1 > 0 (`PIECES`): the row in registers as power-of-two
        # pieces BLOCK, P1, P2, P3 one after the other (4,864 = 4,096 + 512 + 256): one read,
        # and no lanes masked past K as a whole row's next power of two has (8,192: 40 %).
        row = tl.program_id(0).to(tl.int64)
        base = gu_ptr + row * stride_gu
        q_row = q_ptr + row * stride_q
        offs = tl.arange(0, BLOCK)
        if CHUNKED:
            peak = tl.zeros([BLOCK], dtype=tl.float32)
            if INTERPRET:  # Triton's CPU interpreter cannot run a `for` to a runtime bound
                start = 0
                while start < K:
                    peak = _chunk_peak(base, offs, start, K, peak)
                    start += BLOCK
            else:
                for start in range(0, K, BLOCK):
                    peak = _chunk_peak(base, offs, start, K, peak)
            amax = tl.maximum(tl.max(peak, axis=0), EPS * FP8_MAX_C)
            if INTERPRET:
                start = 0
                while start < K:
                    _chunk_store(base, q_row, offs, start, K, amax, FP8_MAX_C)
                    start += BLOCK
            else:
                for start in range(0, K, BLOCK):
                    _chunk_store(base, q_row, offs, start, K, amax, FP8_MAX_C)
            tl.store(s_ptr + row, amax * (1.0 / FP8_MAX_C))
        else:
            o0, m0, x = _piece(base, 0, K, BLOCK)
            if P1 == 0:
                _store_row(x, q_row, s_ptr + row, o0, m0, FP8_MAX_C, EPS)
            else:
                o1, m1, x1 = _piece(base, BLOCK, K, P1)
                peak = tl.maximum(tl.max(tl.abs(x), axis=0), tl.max(tl.abs(x1), axis=0))
                if P2 > 0:
                    o2, m2, x2 = _piece(base, BLOCK + P1, K, P2)
                    peak = tl.maximum(peak, tl.max(tl.abs(x2), axis=0))
                if P3 > 0:
                    o3, m3, x3 = _piece(base, BLOCK + P1 + P2, K, P3)
                    peak = tl.maximum(peak, tl.max(tl.abs(x3), axis=0))
                amax = tl.maximum(peak, EPS * FP8_MAX_C)
                _quantize_store(x, amax, q_row, o0, m0, FP8_MAX_C)
                _quantize_store(x1, amax, q_row, o1, m1, FP8_MAX_C)
                if P2 > 0:
                    _quantize_store(x2, amax, q_row, o2, m2, FP8_MAX_C)
                if P3 > 0:
                    _quantize_store(x3, amax, q_row, o3, m3, FP8_MAX_C)
                tl.store(s_ptr + row, amax * (1.0 / FP8_MAX_C))

    def launch_silu_mul_quant(
        gate_up: torch.Tensor, chunk: int = 0, num_warps: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`silu_mul_quant` with explicit tiles (what `bench_fp8.py` sweeps): `chunk` 0 keeps
        each row whole in one program, `PIECES` too but as power-of-two pieces that end at K
        (`pieces`), else the row goes by `chunk`-wide pieces (a power of two); `num_warps`
        None: by the block width."""
        if gate_up.stride(-1) != 1:
            gate_up = gate_up.contiguous()
        m, k = gate_up.shape[0], gate_up.shape[1] // 2
        q = torch.empty((m, k), dtype=FP8_DTYPE, device=gate_up.device)
        s = torch.empty((m, 1), dtype=torch.float32, device=gate_up.device)
        const = kernel_constants(k, chunk)
        if num_warps is None:
            num_warps = default_warps(const["BLOCK"])
        traceable(_silu_mul_quant_kernel)[(m,)](
            gate_up,
            q,
            s,
            k,
            gate_up.stride(0),
            q.stride(0),
            FP8_MAX_C=FP8_MAX,
            EPS=SCALE_EPS,
            INTERPRET=not gate_up.is_cuda,
            num_warps=num_warps,
            **const,
        )
        return q, s

    @torch.library.triton_op("boundgen::silu_mul_quant", mutates_args=())
    def silu_mul_quant(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up: [M, 2K] (bf16/fp16/fp32, rows contiguous) → (q [M, K] e4m3, scale [M, 1]
        fp32) with q * scale ≈ SiLU(gate_up[:, :K]) * gate_up[:, K:]. Tiles from `TILES`."""
        return launch_silu_mul_quant(gate_up, *TILES.get(gate_up.shape[1] // 2, (0, None)))


# `launch_silu_mul_quant`'s `chunk` for a row in power-of-two pieces that end at K (`pieces`)
PIECES = -1


def pieces(k: int, smallest: int = 64, most: int = 4) -> tuple[int, ...]:
    """K rounded up to `smallest` as the powers of two it sums to, largest first (4,864 →
    4,096, 512, 256; the last piece's lanes past K masked): `PIECES`'s layout of a row."""
    padded = -(-k // smallest) * smallest
    parts = tuple(1 << b for b in range(padded.bit_length() - 1, -1, -1) if padded >> b & 1)
    if len(parts) > most:
        raise ValueError(f"K={k} is {len(parts)} power-of-two pieces; at most {most} are compiled")
    return parts


def kernel_constants(k: int, chunk: int) -> dict[str, int | bool]:
    """`_silu_mul_quant_kernel`'s layout constants for rows of K and `chunk` (0: whole rows,
    `PIECES`, or a piece width): BLOCK, CHUNKED and the extra pieces P1-P3."""
    parts = (*pieces(k), 0, 0, 0) if chunk == PIECES else (0, 0, 0, 0)
    block = parts[0] or chunk or 1 << (k - 1).bit_length()
    return {"BLOCK": block, "CHUNKED": chunk > 0, "P1": parts[1], "P2": parts[2], "P3": parts[3]}


def default_warps(block: int) -> int:
    """Warps for a program of `block` columns when the tile names none."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


# `silu_mul_quant`'s tiles per intermediate size K: (chunk, num_warps), see
# `launch_silu_mul_quant`; sizes not listed keep each row whole with warps by the block width.
# `bench_fp8.py --silu-tiles sweep` times every tile at W1's 8,192 rows (kernel time in a CUDA
# graph), and the fastest per K belongs here. H200, 2026-12-03: K = 4,864 (Qwen2.5-0.5B) as
# pieces 4,096 + 512 + 256 with 4 warps 52.5 µs (89 % of a 4.2 TB/s read + write), the whole row
# with 8 or 16 warps 62.7 / 65.6 µs, 512-2,048-wide pieces 76-94 µs; K = 3,072 (Qwen3-0.6B)
# as 2,048 + 1,024 with 4 warps 31.8 against 34.9 µs; K = 8,192 (Llama-3.2-1B) is one piece,
# the default 8 warps already the fastest (78.0 µs).
TILES: dict[int, tuple[int, int | None]] = {3072: (PIECES, 4), 4864: (PIECES, 4)}


def silu_mul_quant_reference(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What `silu_mul_quant` computes, in plain torch (eager's ops, then `quantize_rowwise`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return quantize_rowwise(torch.nn.functional.silu(gate) * up)


def quantize_rowwise_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] CUDA (bf16/fp16/fp32) -> (q [M, K] e4m3, scale [M, 1] fp32)."""
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    block = triton.next_power_of_2(K)
    num_warps = 4 if block <= 2048 else 8
    _quant_rows_kernel[(M,)](
        x,
        q,
        s,
        K,
        x.stride(0),
        q.stride(0),
        BLOCK=block,
        FP8_MAX_C=FP8_MAX,
        EPS=SCALE_EPS,
        num_warps=num_warps,
    )
    return q, s


@functools.cache
def self_test(device_index: int = 0) -> str | None:
    """Compare the kernel with the torch quantizer once per device; None if they agree, else why
    not."""
    if not AVAILABLE:
        return "triton is not installed"
    try:
        dev = torch.device("cuda", device_index)
        g = torch.Generator(device=dev).manual_seed(0)  # leave the global RNG alone
        x = torch.randn(37, 896, device=dev, dtype=torch.bfloat16, generator=g) * 3
        x[5] = 0
        q1, s1 = quantize_rowwise_triton(x)
        q2, s2 = quantize_rowwise(x)
        if not torch.allclose(s1, s2, rtol=1e-6, atol=0):
            return "scales differ from the torch quantizer"
        mismatch = (q1.float() != q2.float()).float().mean().item()
        if mismatch > 1e-3:  # division rounding may differ in the last bit for a few elements
            return f"{mismatch:.2%} of quantized values differ from the torch quantizer"
        gate_up = torch.randn(37, 2 * 448, device=dev, dtype=torch.bfloat16, generator=g) * 3
        (q1, s1), (q2, s2) = silu_mul_quant(gate_up), silu_mul_quant_reference(gate_up)
        if not torch.allclose(s1, s2, rtol=1e-2, atol=0):  # exp may differ in the last bit
            return "SiLU·mul scales differ from eager's SiLU·mul and the torch quantizer"
        mismatch = (q1.float() != q2.float()).float().mean().item()
        if mismatch > 1e-2:
            return f"{mismatch:.2%} of SiLU·mul quantized values differ from eager's"
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
