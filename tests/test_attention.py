"""Attention backends and the cascade (shared-prefix) merge, against materialised full attention."""

from __future__ import annotations

import math

import pytest
import torch

from boundgen.attention.backends import get_backend
from boundgen.attention.cascade import grouped_rows_attention, merge_partial, prefill_attention
from boundgen.text.packing import SequenceGroup, pack


def dense_causal(q, k, v):
    """One sequence, plain causal softmax attention in float64 (the oracle)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def random_qkv(t, hq=4, hkv=2, d=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda h: torch.randn(t, h, d, generator=g, device=device).to(dtype)
    return mk(hq), mk(hkv), mk(hkv)


def check_cascade(backend, dtype, device, atol):
    groups = [
        SequenceGroup(list(range(7)), [[1] * 3, [2] * 5, [], [3]]),
        SequenceGroup([], [[4] * 6, [5] * 2]),
        SequenceGroup(list(range(4)), [[6] * 2, [7] * 4]),
    ]
    batch = pack(groups).to(device)
    q, k, v = random_qkv(batch.num_tokens, dtype=dtype, device=device)
    out = prefill_attention(q, k, v, batch.attn, backend)
    # Oracle: rebuild each full sequence's q/k/v rows and run dense causal attention on it.
    shared = [i for i, g in enumerate(groups) if g.prefix and len(g.suffixes) >= 2]
    n = 0
    for g_idx, g in enumerate(groups):
        for s in g.suffixes:
            last, start = batch.last_index[n].item(), batch.seq_start[n].item()
            if start >= 0:  # plain sequence: contiguous rows
                rows = list(range(start, last + 1))
            else:  # shared prefix rows, then the suffix's own rows
                p0 = batch.attn.cu_prefix[shared.index(g_idx)].item()
                rows = list(range(p0, p0 + len(g.prefix))) + list(
                    range(last - len(s) + 1, last + 1) if s else []
                )
            ref = dense_causal(q[rows], k[rows], v[rows])
            assert torch.allclose(out[rows[-1]].double(), ref[-1], atol=atol), (g_idx, n)
            n += 1


def test_reference_cascade_matches_dense_attention():
    check_cascade(get_backend("reference", "cpu"), torch.float32, "cpu", 1e-5)


@pytest.mark.gpu
def test_varlen_cascade_matches_dense_attention():
    # bf16 inputs, fp32 accumulation inside flash attention: ~1e-2 absolute on unit-variance values.
    check_cascade(get_backend("varlen", "cuda"), torch.bfloat16, "cuda", 2e-2)


def test_merge_of_split_keys_equals_attention_over_all_keys():
    backend = get_backend("reference", "cpu")
    q, k, v = random_qkv(12, seed=3)
    cu = lambda *xs: torch.tensor(xs, dtype=torch.int32)
    full, full_lse = backend.varlen(q[:4], k, v, cu(0, 4), cu(0, 12), 4, 12, False)
    oa, la = backend.varlen(q[:4], k[:5], v[:5], cu(0, 4), cu(0, 5), 4, 5, False)
    ob, lb = backend.varlen(q[:4], k[5:], v[5:], cu(0, 4), cu(0, 7), 4, 7, False)
    assert torch.allclose(merge_partial(oa, la, ob, lb), full, atol=1e-6)
    assert torch.allclose(torch.logaddexp(la, lb), full_lse, atol=1e-6)


def check_grouped_rows(backend, dtype, device, atol):
    """Each beam's query heads over its prompt's keys, taken as rows of their KV head
    (`grouped_rows_attention`), equal every (row, head) attended alone in float64, output and
    log-sum-exp; so does the same call with the heads as they are (group 1)."""
    hq, hkv, d = 6, 2, 16
    group = hq // hkv
    rows_per_prompt, keys_per_prompt = [2, 3, 1], [5, 7, 4]
    q, _, _ = random_qkv(sum(rows_per_prompt), hq=hq, hkv=hkv, d=d, dtype=dtype, seed=5)
    _, k, v = random_qkv(sum(keys_per_prompt), hq=hq, hkv=hkv, d=d, dtype=dtype, seed=6)
    cu = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32)
    cu_q, cu_k = cu(rows_per_prompt), cu(keys_per_prompt)
    want_out, want_lse = torch.empty(q.shape, dtype=torch.float64), torch.empty(q.shape[:2])
    for b in range(3):
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        for n in range(int(cu_q[b]), int(cu_q[b + 1])):
            for h in range(hq):  # query head h reads KV head h // group (HF's repeat_kv)
                s_ = (k[keys, h // group].double() @ q[n, h].double()) / math.sqrt(d)
                want_lse[n, h] = torch.logsumexp(s_, 0)
                want_out[n, h] = torch.softmax(s_, 0) @ v[keys, h // group].double()
    dev = lambda t: t.to(device)
    # q as the heads come ([N, Hq, D]), grouped by KV head already ([N, G, Hkv, D]), ungrouped
    grouped = q.view(-1, hkv, group, d).transpose(1, 2).contiguous()
    for q_in, g in ((q, group), (grouped, group), (q, 1)):
        cu_rows = dev(cu_q * g)
        out, lse = grouped_rows_attention(
            dev(q_in), dev(k), dev(v), cu_rows, dev(cu_k), 3 * g, 7, g, backend
        )
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:2]
        assert torch.allclose(out.double().cpu(), want_out, atol=atol)
        assert torch.allclose(lse.double().cpu(), want_lse.double(), atol=atol)


def test_grouped_rows_attention_equals_each_head_alone():
    check_grouped_rows(get_backend("reference", "cpu"), torch.float32, "cpu", 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["varlen", "flash"])
def test_grouped_rows_attention_on_cuda(name):
    """The same through flash attention (the decode step's backends on the GPU)."""
    if name == "flash":
        from boundgen.compile.attention import FlashBackend

        backend = FlashBackend()
    else:
        backend = get_backend("varlen", "cuda")
    check_grouped_rows(backend, torch.bfloat16, "cuda", 2e-2)


def test_causal_alignment_is_bottom_right():
    """Fewer queries than keys: the last query sees every key, the first sees all but the last
    Lq-1."""
    backend = get_backend("reference", "cpu")
    q, k, v = random_qkv(6, seed=4)
    cu = lambda *xs: torch.tensor(xs, dtype=torch.int32)
    out, _ = backend.varlen(q[4:], k, v, cu(0, 2), cu(0, 6), 2, 6, True)
    full = dense_causal(q, k, v)
    assert torch.allclose(out.double(), full[4:], atol=1e-5)


def test_packing_layout_positions_and_rows():
    groups = [
        SequenceGroup([10, 11, 12], [[1, 2], [3]]),
        SequenceGroup([], [[4, 5, 6]]),
        SequenceGroup([20], [[7]]),
    ]
    b = pack(groups)
    assert b.input_ids.tolist() == [10, 11, 12, 1, 2, 3, 4, 5, 6, 20, 7]
    assert b.positions.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 0, 1]
    assert b.last_index.tolist() == [4, 5, 8, 10]
    assert b.attn.cu_seqlens.tolist() == [0, 3, 5, 6, 9, 11]
    assert b.attn.cu_prefix.tolist() == [0, 3] and b.attn.cu_group_q.tolist() == [0, 3]
    assert b.rows_per_group == [2, 1, 1]
    plain = pack(groups, share_prefix=False)
    assert plain.attn.cu_prefix is None and plain.num_tokens == 5 + 4 + 3 + 2


def test_empty_sequence_is_rejected():
    with pytest.raises(ValueError, match="empty sequence"):
        pack([SequenceGroup([], [[]])])
