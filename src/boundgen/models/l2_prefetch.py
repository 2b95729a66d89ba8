"""Weights fetched into L2 ahead of the kernels that read them: one small kernel whose threads each
issue one `cp.async.bulk.prefetch.L2.global` (Hopper's bulk prefetch: the copy engine fetches a
whole span, no register or shared memory holds it) and exit.

A few-row layer (W3's 64-token prompt, a beam decode step) is latency-bound: its GEMMs stream
their weights at 10–58 % of HBM speed (H100, forty-fourth session) because a kernel of one wave
cannot keep enough loads in flight. A span of the next kernels' weights already in L2 is read at
L2's latency and bandwidth instead, and the fetch itself runs while the kernels before them
(attention, the norms, the small projections) leave HBM idle.

`launch(tensors, chunk)`: each of up to four contiguous tensors cut into `chunk`-byte spans, one
span a thread, `LANES` threads a program (one warp). The prefetch is a hint: nothing waits for
it and a result never depends on it. The assembly is impure (else it is dropped as dead code: its
dummy result is unused) and takes operands (the span's address and size).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from boundgen.triton_launch import traceable

    AVAILABLE = True
except Exception:  # pragma: no cover - triton ships with CUDA torch and the dev extra
    AVAILABLE = False

# Bytes a thread prefetches (one bulk prefetch), threads a program
CHUNK, LANES = 64 * 1024, 32
# The most tensors one launch prefetches
MAX_TENSORS = 4

# one span ($1: address, $2: bytes) fetched into L2 where $3 is nonzero; $0 a dummy result
PREFETCH_ASM = (
    "{ .reg .pred p; setp.ne.b32 p, $3, 0; "
    "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)


if AVAILABLE:
    _ASM = tl.constexpr(PREFETCH_ASM)  # a kernel reads module globals only as constexprs

    @triton.jit
    def _span(c, first, base, nbytes, CHUNK: tl.constexpr):
        """Chunk `c`'s address and size in a tensor whose chunks start at index `first`."""
        off = (c - first).to(tl.int64) * CHUNK
        size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)
        return base + off, size

    @triton.jit
    def _prefetch_kernel(
        A,
        B,
        C,
        D,
        A_BYTES: tl.constexpr,
        B_BYTES: tl.constexpr,
        C_BYTES: tl.constexpr,
        D_BYTES: tl.constexpr,
        CHUNK: tl.constexpr,
        LANES: tl.constexpr,
    ):
        """Thread i of program p prefetches chunk p·LANES + i of A, B, C, D laid end to end."""
        c = tl.program_id(0) * LANES + tl.arange(0, LANES)
        ca = (A_BYTES + CHUNK - 1) // CHUNK
        cb = ca + (B_BYTES + CHUNK - 1) // CHUNK
        cc = cb + (C_BYTES + CHUNK - 1) // CHUNK
        cd = cc + (D_BYTES + CHUNK - 1) // CHUNK
        pa, sa = _span(c, 0, A, A_BYTES, CHUNK)
        pb, sb = _span(c, ca, B, B_BYTES, CHUNK)
        pc, sc = _span(c, cb, C, C_BYTES, CHUNK)
        pd, sd = _span(c, cc, D, D_BYTES, CHUNK)
        ptr = tl.where(c < ca, pa, tl.where(c < cb, pb, tl.where(c < cc, pc, pd)))
        size = tl.where(c < ca, sa, tl.where(c < cb, sb, tl.where(c < cc, sc, sd)))
        tl.inline_asm_elementwise(
            _ASM,
            "=r,l,r,r",
            [ptr, size, (c < cd).to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    def launch(tensors, chunk: int = CHUNK, lanes: int = LANES) -> None:
        """Prefetch up to `MAX_TENSORS` contiguous CUDA tensors into L2 (each a multiple of 16
        bytes, the bulk prefetch's unit), `chunk` bytes a thread."""
        tensors = list(tensors)
        if not 1 <= len(tensors) <= MAX_TENSORS:
            raise ValueError(f"prefetch takes 1–{MAX_TENSORS} tensors, got {len(tensors)}")
        if chunk % 16:
            raise ValueError(f"chunk {chunk}: not a multiple of 16 bytes")
        spans = []
        for t in tensors:
            if not (t.is_cuda and t.is_contiguous()):
                raise ValueError("prefetch takes contiguous CUDA tensors")
            nbytes = t.numel() * t.element_size()
            if nbytes % 16:
                raise ValueError(f"a tensor of {nbytes} bytes: not a multiple of 16")
            spans.append((t.view(-1).view(torch.uint8), nbytes))
        while len(spans) < MAX_TENSORS:
            spans.append((spans[0][0], 0))
        chunks = sum(triton.cdiv(n, chunk) for _, n in spans)
        traceable(_prefetch_kernel)[(triton.cdiv(chunks, lanes),)](
            *(t for t, _ in spans),
            *(n for _, n in spans),
            CHUNK=chunk,
            LANES=lanes,
            num_warps=max(1, lanes // 32),
            num_stages=1,
        )
