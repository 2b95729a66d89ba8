"""`row_logsumexp` (the trie step's normaliser over the full vocabulary): the Triton kernels (in
Triton's CPU interpreter here, on the device in the GPU run) against `torch.logsumexp`."""

from __future__ import annotations

import pytest
import torch

from boundgen import logsumexp
from boundgen.logsumexp import CHUNK, row_logsumexp

pytestmark = pytest.mark.skipif(not logsumexp.AVAILABLE, reason="needs triton")


@pytest.mark.parametrize(
    "rows, cols",
    [(3, 37), (2, CHUNK), (4, 2 * CHUNK + 5), (1, 3 * CHUNK - 1)],
    ids=["one-partial-block", "one-whole-chunk", "three-chunks", "last-block-partial"],
)
def test_the_kernels_match_torch_logsumexp(rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g) * 6
    x[0, cols // 2] = 60.0  # one dominant column: the running max must rescale the sum
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = x.to(device)
    got = row_logsumexp(x, kernel=True)
    assert got.dtype == torch.float32 and got.shape == (rows,)
    torch.testing.assert_close(got, torch.logsumexp(x, 1), rtol=1e-5, atol=1e-5)


def test_bf16_rows_are_summed_in_float32():
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    if torch.cuda.is_available():
        x = x.cuda()
    want = torch.logsumexp(x.float(), 1)
    torch.testing.assert_close(row_logsumexp(x, kernel=True), want, rtol=1e-5, atol=1e-5)


def test_no_rows_and_strided_rows():
    assert row_logsumexp(torch.empty(0, 50), kernel=True).shape == (0,)
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="contiguous columns"):
        row_logsumexp(x.t(), kernel=True)
    # rows apart by more than their length (a slice of wider rows) are read in place
    wide = torch.randn(3, 80)
    torch.testing.assert_close(
        row_logsumexp(wide[:, :50], kernel=True), torch.logsumexp(wide[:, :50], 1)
    )


def test_cpu_tensors_take_torch_by_default():
    x = torch.randn(2, 10)
    assert torch.equal(row_logsumexp(x), torch.logsumexp(x, 1))
