"""Compiled backends on CUDA (skipped without it): flash export attention, CUDA graphs, AOTInductor
parity.

The AOTInductor test compiles the tiny model once (≈ 40–80 s on the GPU machine) and is marked
slow.
"""

from __future__ import annotations

import pytest
import torch

from boundgen.compile.backends import CompileOptions
from boundgen.compile.buckets import Bucket
from boundgen.runner import make_runner

pytestmark = pytest.mark.gpu

BUCKETS = ["t64-s12-m32-g3-p24-q24", "t128-s8-m128"]


@pytest.fixture(scope="module")
def cuda_engine(tiny_model):
    from boundgen import Engine

    return Engine.from_pretrained(
        tiny_model("qwen2"), device="cuda", dtype="bfloat16", attention="varlen", backend="eager"
    )


@pytest.mark.parametrize("causal", [True, False])
def test_flash_matches_varlen(causal):
    from boundgen.attention.backends import get_backend
    from boundgen.compile.attention import FlashBackend

    g = torch.Generator(device="cuda").manual_seed(0)
    lq = [3, 0, 5, 1, 7]
    lk = lq if causal else [2, 4, 7, 1, 3]
    cu = lambda ls: torch.tensor(
        [0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32, device="cuda"
    )
    q = torch.randn(sum(lq), 14, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(sum(lk), 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sum(lk), 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    o1, l1 = get_backend("varlen", "cuda").varlen(q, k, v, cu(lq), cu(lk), 7, 7, causal)
    o2, l2 = FlashBackend().varlen(q, k, v, cu(lq), cu(lk), 7, 7, causal)
    torch.testing.assert_close(o2, o1)
    torch.testing.assert_close(l2, l1)


def _scores(engine):
    return torch.tensor(
        engine.score(
            "the quick brown fox", ["jumps over", "a lazy dog", "x"], [5, 17], apply_softmax=True
        )
    )


def test_eager_graphs_match_eager(cuda_engine):
    e = cuda_engine.with_runner(
        make_runner(
            cuda_engine.model,
            cuda_engine.device,
            4096,
            True,
            "eager+graphs",
            CompileOptions(buckets=BUCKETS, graph_max_tokens=128),
        )
    )
    assert e.runner.backend_name == "eager+graphs"
    for _ in range(2):  # replays reuse the static buffers
        torch.testing.assert_close(_scores(e), _scores(cuda_engine), atol=2e-2, rtol=0)
    torch.testing.assert_close(
        e.embed(["one two three", "four"]),
        cuda_engine.embed(["one two three", "four"]),
        atol=2e-2,
        rtol=0,
    )


def test_auto_on_cuda_is_eager_graphs_without_artifacts(cuda_engine, tmp_path):
    """The default backend on CUDA with an empty artifact cache: eager + CUDA graphs, same
    scores."""
    e = cuda_engine.with_runner(
        make_runner(
            cuda_engine.model,
            cuda_engine.device,
            4096,
            True,
            "auto",
            CompileOptions(cache_dir=tmp_path),
        )
    )
    assert e.runner.backend_name == "eager+graphs"
    assert max(b.tokens for b in e.runner.forwards.buckets) <= CompileOptions().graph_max_tokens
    torch.testing.assert_close(
        _scores(e), _scores(cuda_engine), atol=2e-2, rtol=0
    )  # cascade: eager
    texts = ["one two three", "four"]
    torch.testing.assert_close(e.embed(texts), cuda_engine.embed(texts), atol=2e-2, rtol=0)
    assert e.runner.stats()["batches"], "the plain batch should have run in a captured bucket"


@pytest.mark.slow
def test_aoti_cuda_matches_eager(cuda_engine, tmp_path):
    from boundgen.compile.preload import AOTIUnsafe

    for backend in ("aoti", "aoti+graphs"):
        try:
            runner = make_runner(
                cuda_engine.model,
                cuda_engine.device,
                4096,
                True,
                backend,
                CompileOptions(
                    buckets=[Bucket.parse(BUCKETS[0])], cache_dir=tmp_path, allow_reexec=False
                ),
            )
        except AOTIUnsafe as exc:  # the guard worked (no segfault); the process needs the preload
            pytest.skip(f"AOTInductor load needs a preload in this process: {exc}")
        e = cuda_engine.with_runner(runner)
        torch.testing.assert_close(_scores(e), _scores(cuda_engine), atol=2e-2, rtol=0)
        assert e.runner.stats()["misses"] == 0


def test_decode_graphs_match_plain_decode(cuda_engine):
    """Graphed decode steps on persistent buffers = the plain decode path, across two requests."""
    from boundgen.compile.buckets import parse_buckets
    from boundgen.compile.decode import DecodeGraphs
    from boundgen.kv import BeamKV, DecodeKV, PromptKV
    from boundgen.text.packing import SequenceGroup, pack

    model, dev = cuda_engine.model, cuda_engine.device
    cfg, dtype = model.config, model.embed_tokens.weight.dtype
    dg = DecodeGraphs(model, dev, parse_buckets(["t32", "t64"]), use_graphs=True)
    g = torch.Generator().manual_seed(0)
    w, steps = 4, 4
    with torch.inference_mode():
        for _ in range(2):
            prompts = [torch.randint(1, 400, (k,), generator=g).tolist() for k in (7, 12)]
            n = len(prompts) * w
            batch = pack([SequenceGroup([], prompts)], share_prefix=False).to(dev)
            pkv = PromptKV(
                cfg.num_layers, batch.num_tokens, cfg.num_kv_heads, cfg.head_dim, dtype, dev
            )
            model(batch.input_ids, batch.positions, batch.attn, pkv)
            plain = DecodeKV(
                pkv,
                batch.attn.cu_seqlens,
                batch.attn.max_seqlen,
                BeamKV(cfg.num_layers, n, steps, cfg.num_kv_heads, cfg.head_dim, dtype, dev),
                torch.arange(0, n + 1, w, dtype=torch.int32, device=dev),
                w,
            )
            s = dg.open(prompts, w, steps)
            try:
                base = torch.repeat_interleave(batch.seq_len, w)
                for step in range(1, steps):
                    tokens = torch.randint(1, 400, (n,), generator=g).to(dev)
                    parent = torch.randint(0, n, (n,), generator=g).to(dev)
                    plain.step = step - 1
                    want = model.head(model(tokens, base + step - 1, None, plain))
                    got = s.step(step - 1, tokens, base + step - 1)
                    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
                    plain.beams.reorder(parent)
                    s.state.beams.reorder(parent)
            finally:
                s.close()
        assert len(dg.slots) == 1 and len(next(iter(dg.slots.values())).graphs) == steps - 1
