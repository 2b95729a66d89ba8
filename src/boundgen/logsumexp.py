"""`row_logsumexp`: each row's log-sum-exp in one read of the row (Triton on CUDA).

A trie step scored over the full vocabulary (the default, HF's semantics) needs of each beam's
logits only its trie children's values and the row's log-sum-exp: log p(child) = z[child] − lse.
`log_softmax` over the rows instead writes every log-prob and reads them back for the gather: at
W4's merged searches (512 rows × 151,936 columns, float32) its kernel took 0.24 ms a step on the
H200 (`/v1/beam` at saturation, BENCHMARKS.md 2026-12-03 twelfth session), its write alone 311 MB.
Here each row is cut into chunks, one program a (row, chunk) reads its chunk once and keeps a
running max and sum of exponentials (so a few-row step still fills the GPU), and a second launch
merges a row's chunks. ATen's `logsumexp` is several kernels over the rows (max, subtract, exp,
sum, log), so CPU tensors take it and CUDA ones this kernel.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # pragma: no cover - triton ships with CUDA torch and the dev extra
    AVAILABLE = False

# Columns a program reduces (151,936 → 19 chunks a row), columns a loop iteration loads.
CHUNK, BLOCK = 8192, 1024


if AVAILABLE:

    @triton.jit
    def _chunk_kernel(
        x_ptr, m_ptr, s_ptr, cols, stride, parts, CHUNK: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        part = tl.program_id(1)
        start = part * CHUNK
        base = x_ptr + row.to(tl.int64) * stride
        # a chunk starts below `cols`: its first block is never empty, so m is finite after it
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(base + idx, mask=idx < cols, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        s = tl.sum(tl.exp(x - m), 0)
        for off in range(BLOCK, CHUNK, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            x = tl.load(base + idx, mask=idx < cols, other=float("-inf")).to(tl.float32)
            new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - new) + tl.sum(tl.exp(x - new), 0)
            m = new
        tl.store(m_ptr + row * parts + part, m)
        tl.store(s_ptr + row * parts + part, s)

    @triton.jit
    def _merge_kernel(m_ptr, s_ptr, out_ptr, parts, PARTS: tl.constexpr):
        row = tl.program_id(0)
        i = tl.arange(0, PARTS)
        m = tl.load(m_ptr + row * parts + i, mask=i < parts, other=float("-inf"))
        s = tl.load(s_ptr + row * parts + i, mask=i < parts, other=0.0)
        top = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - top), 0)
        tl.store(out_ptr + row, top + tl.log(total))


def row_logsumexp(x: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """x [N, C] (any float dtype, rows contiguous) → float32 [N]: log Σ_j exp(x[n, j]).
    `kernel`: the Triton kernels (default: on CUDA, where Triton is there; True on CPU tensors runs
    them in Triton's interpreter, TRITON_INTERPRET=1: the tests)."""
    if kernel is None:
        kernel = AVAILABLE and x.is_cuda
    if not kernel:
        return torch.logsumexp(x.float(), dim=1)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"row_logsumexp takes rows of contiguous columns, got {tuple(x.shape)}")
    n, cols = x.shape
    if n == 0 or cols == 0:
        return torch.logsumexp(x.float(), dim=1)
    parts = triton.cdiv(cols, CHUNK)
    m = torch.empty(n, parts, dtype=torch.float32, device=x.device)
    s = torch.empty_like(m)
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    _chunk_kernel[(n, parts)](x, m, s, cols, x.stride(0), parts, CHUNK=CHUNK, BLOCK=BLOCK)
    _merge_kernel[(n,)](m, s, out, parts, PARTS=triton.next_power_of_2(parts))
    return out
