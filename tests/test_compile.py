"""Compiled model nodes: buckets/padding, masked attention, AOTInductor parity, artifact cache,
preload guard.

The tiny model is AOTInductor-compiled once per session into one cascade bucket (which also takes
plain batches), ~40 s on a CI CPU; every cache test reuses that artifact or a stub builder.
"""

from __future__ import annotations

import copy
import json
import logging
import resource
import shutil
import sys
import time

import pytest
import torch

from boundgen.attention.backends import ReferenceBackend
from boundgen.compile import cache as cache_mod
from boundgen.compile import preload
from boundgen.compile.attention import MaskedBackend
from boundgen.compile.backends import (
    COMPILED_GRAPH_MAX_TOKENS,
    EAGER_GRAPH_MAX_TOKENS,
    CompiledForwards,
    CompileOptions,
    _eager_fns,
    aoti_slots,
    build_aoti,
)
from boundgen.compile.buckets import Bucket, BucketSet, default_buckets, parse_buckets
from boundgen.compile.cache import ArtifactCache, ArtifactError, platform_info
from boundgen.compile.events import COMPILES, TORCH_COMPILE, watch_dynamo
from boundgen.runner import ModelRunner, make_runner
from boundgen.text.packing import SequenceGroup, pack

BUCKET = Bucket.parse("t64-s12-m32-g3-p24-q24")


def _ids(gen, n, vocab=500):
    return torch.randint(1, vocab, (n,), generator=gen).tolist()


def _groups(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [
        SequenceGroup(_ids(g, 9), [_ids(g, 3), _ids(g, 5), _ids(g, 1)]),
        SequenceGroup(_ids(g, 6), [_ids(g, 4), _ids(g, 2)]),
        SequenceGroup([], [_ids(g, 11), _ids(g, 7)]),
    ]


# -- buckets and attention (no compile)
# --------------------------------------------------------------
def test_bucket_parse_and_names():
    b = Bucket.parse("t2048-s64-m256-g4-p512-q1024")
    assert (b.tokens, b.segments, b.max_seqlen, b.groups, b.prefix_tokens, b.shared_tokens) == (
        2048,
        64,
        256,
        4,
        512,
        1024,
    )
    assert Bucket.parse(b.name) == b
    assert Bucket.parse("t256") == Bucket(256, 8, 256)
    assert [x.tokens for x in default_buckets(1024)] == [64, 128, 256, 512, 1024]
    assert parse_buckets("t64, t128") == [Bucket.parse("t64"), Bucket.parse("t128")]
    for bad in ("x12", "t", "s4", "t64-z3", "t64-g2", "t64-g1-p40-q40"):
        with pytest.raises(ValueError):
            Bucket.parse(bad)


@pytest.mark.parametrize("causal", [True, False])
def test_masked_attention_matches_reference(causal):
    g = torch.Generator().manual_seed(1)
    lq = [3, 0, 5, 1, 7]
    lk = lq if causal else [2, 4, 7, 1, 3]
    cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32)
    tq, tk = sum(lq) + 3, sum(lk) + 2  # rows past the last segment (padding) too
    q = torch.randn(tq, 4, 8, generator=g)
    k, v = torch.randn(tk, 2, 8, generator=g), torch.randn(tk, 2, 8, generator=g)
    o1, l1 = ReferenceBackend().varlen(q, k, v, cu(lq), cu(lk), 7, 7, causal)
    o2, l2 = MaskedBackend().varlen(q, k, v, cu(lq), cu(lk), 7, 7, causal)
    torch.testing.assert_close(o2, o1, atol=1e-6, rtol=1e-6)
    assert torch.equal(torch.isinf(l1), torch.isinf(l2))
    torch.testing.assert_close(l2[l1.isfinite()], l1[l1.isfinite()], atol=1e-6, rtol=1e-6)


def test_padding_keeps_real_rows_exact(engine_for):
    """Padded into a bucket, every real output row equals the unpadded forward (reference and
    masked)."""
    model = engine_for("qwen2").model
    masked = copy.copy(model)
    masked.backend = MaskedBackend()
    buckets = BucketSet([Bucket.parse("t32"), BUCKET, Bucket.parse("t128-s16-m64-g4-p48-q48")])
    cases = [
        _groups(0),
        [SequenceGroup([], [[5, 6, 7], [8] * 20])],
        [SequenceGroup([1, 2, 3], [[4], [5, 6]])],
    ]
    with torch.inference_mode():
        for groups in cases:
            batch = pack(groups)
            bucket, padded = buckets.pad(batch)
            assert bucket is not None and padded.num_tokens == bucket.tokens
            want = model(batch.input_ids, batch.positions, batch.attn).index_select(
                0, batch.last_index
            )
            for m in (model, masked):
                got = m(padded.input_ids, padded.positions, padded.attn).index_select(
                    0, padded.last_index
                )
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    s = buckets.stats
    assert s.real_tokens < s.padded_tokens and s.misses == 0 and 0 < s.padding_fraction < 1


def test_smallest_bucket_and_misses():
    small, big = Bucket.parse("t32-s4-m32"), Bucket.parse("t64-s8-m64")
    casc = Bucket.parse("t64-s8-m32-g2-p16-q16")
    bs = BucketSet([big, casc, small])
    assert bs.choose(pack([SequenceGroup([], [[1] * 10, [2] * 5])])) == small
    assert bs.choose(pack([SequenceGroup([], [[1] * 40])])) == big
    assert bs.choose(pack([SequenceGroup([1] * 10, [[2] * 3, [3] * 4])])) == casc
    # prefix fills P exactly: pad suffix rows would have no pad keys → does not fit
    assert bs.choose(pack([SequenceGroup([1] * 16, [[2] * 3, [3] * 4])])) is None
    bucket, same = bs.pad(pack([SequenceGroup([], [[1] * 100])]))
    assert bucket is None and bs.stats.misses == 1 and same.num_tokens == 100


# -- AOTInductor (one compile per session)
# -----------------------------------------------------------
@pytest.fixture(scope="session")
def aoti_cache(tmp_path_factory, engine_for):
    """A cache holding the tiny qwen2 model compiled for BUCKET (built once)."""
    root = tmp_path_factory.mktemp("aoti-cache")
    engine = engine_for("qwen2")
    inductor = torch._inductor.config
    before = inductor.get_config_copy()
    ((_, _entry, info),) = build_aoti(engine.model, engine.device, [BUCKET], ArtifactCache(root))
    assert info["event"] == "built"
    # the process's own Inductor settings as they were: they are a part of the cache key of any
    # later `torch.compile` (the beam layers `boundgen compile` compiles after its buckets)
    changed = {k for k, v in inductor.get_config_copy().items() if before.get(k) != v}
    assert not changed, changed
    # the C++ build is split by part (what the W5 compile's 38 s a bucket is made of)
    assert info["phases_s"].get("C++ compile wrapper", 0) > 0, info["phases_s"]
    return root


def _aoti_engine(engine, root, **kw):
    return engine.with_runner(
        make_runner(
            engine.model,
            engine.device,
            4096,
            True,
            "aoti",
            CompileOptions(buckets=[BUCKET], cache_dir=root, **kw),
        )
    )


def test_aoti_scores_match_eager(engine_for, aoti_cache):
    eager = engine_for("qwen2")
    aoti = _aoti_engine(eager, aoti_cache, rebuild=False)
    assert aoti.runner.backend_name == "aoti"
    query, items = "the quick brown fox", ["jumps over", "a lazy dog today", "x"]
    labels = [5, 17, 99]
    want = eager.score(query, items, labels, apply_softmax=True)
    got = aoti.score(query, items, labels, apply_softmax=True)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)
    for pooling in ("last", "mean"):  # plain batches (no shared prefix) in the cascade bucket
        want = eager.embed(["one two three", "four five"], pooling=pooling)
        got = aoti.embed(["one two three", "four five"], pooling=pooling)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    stats = aoti.runner.stats()
    assert stats["misses"] == 0 and stats["batches"] == {BUCKET.name: 3}
    # the runner's forward() keeps ModelRunner's contract (hidden of the batch's own tokens)
    batch = pack(_groups(3)[:2])
    with torch.inference_mode():
        torch.testing.assert_close(
            aoti.runner.forward(batch), eager.runner.forward(batch), atol=1e-5, rtol=1e-5
        )
    # the runtime's path: pieces (pack + pad on the host) → stage → forward on the padded batch
    batch = pack(_groups(4)[:2])  # two shared-prefix groups: fits BUCKET
    ((staged, padded),) = aoti.runner.pieces(_groups(4)[:2], ["last"] * 5)
    assert staged is None and padded.num_tokens == BUCKET.tokens  # aoti on CPU: no staged graph
    with torch.inference_mode():
        got = aoti.runner.forward(padded).index_select(0, padded.last_index)
        want = eager.runner.forward(batch).index_select(0, batch.last_index)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # too large for every bucket → eager, counted
    long_text = " ".join(["word"] * 80)
    torch.testing.assert_close(
        aoti.embed([long_text]), eager.embed([long_text]), atol=1e-5, rtol=1e-5
    )


def test_aoti_buckets_share_one_weight_copy(engine_for, aoti_cache):
    engine = engine_for("qwen2")
    runner = make_runner(
        engine.model,
        engine.device,
        4096,
        True,
        "aoti",
        CompileOptions(buckets=None, cache_dir=aoti_cache, rebuild=False),
    )
    assert [b.name for b in runner.buckets] == [BUCKET.name]  # found through the manifest
    fn = runner.forwards.fns[BUCKET]
    consts = fn.compiled.get_constant_fqns()
    assert consts and all(c.startswith("model.") for c in consts)


def test_cache_hit_does_not_build(engine_for, aoti_cache, monkeypatch):
    engine = engine_for("qwen2")
    monkeypatch.setattr(
        "boundgen.compile.backends.build_package",
        lambda *a, **k: pytest.fail("cache hit must not rebuild"),
    )
    ((_, _, info),) = build_aoti(
        engine.model, engine.device, [BUCKET], ArtifactCache(aoti_cache), rebuild=False
    )
    assert info["event"] == "hit"
    manifest = json.loads((aoti_cache / "manifest.json").read_text())
    (entry,) = manifest["entries"].values()
    assert (
        entry["slot"]["bucket"] == BUCKET.name and entry["platform"]["torch"] == torch.__version__
    )


@pytest.fixture
def cache_copy(aoti_cache, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(aoti_cache, root)
    return root


def _stub_builder(source_pkg):
    calls = []

    def build(path):
        calls.append(path)
        shutil.copy(source_pkg, path)
        return {"export_s": 0.0, "compile_s": 0.0}

    return build, calls


@pytest.mark.parametrize("damage", ["stale", "corrupt", "missing_file", "bad_meta"])
def test_damaged_artifact_is_never_loaded(engine_for, cache_copy, aoti_cache, damage):
    engine = engine_for("qwen2")
    cache = ArtifactCache(cache_copy)
    (slot,) = aoti_slots(engine.model, engine.device, [BUCKET], "none")
    plat = platform_info(engine.device)
    d = cache.dir_for(slot)
    good_pkg = ArtifactCache(aoti_cache).dir_for(slot) / "package.pt2"
    if damage == "stale":
        meta = json.loads((d / "meta.json").read_text())
        meta["platform"]["torch"] = "2.11.0+cu130"
        (d / "meta.json").write_text(json.dumps(meta))
        kind = "stale"
    elif damage == "corrupt":
        data = bytearray((d / "package.pt2").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (d / "package.pt2").write_bytes(bytes(data))
        kind = "corrupt"
    elif damage == "missing_file":
        (d / "package.pt2").unlink()
        kind = "corrupt"
    else:
        (d / "meta.json").write_text("{not json")
        kind = "corrupt"
    with pytest.raises(ArtifactError) as err:
        cache.lookup(slot, plat)
    assert err.value.kind == kind
    # rebuilding off: a clear refusal naming the fix
    with pytest.raises(ArtifactError, match="boundgen compile"):
        make_runner(
            engine.model,
            engine.device,
            4096,
            True,
            "aoti",
            CompileOptions(buckets=[BUCKET], cache_dir=cache_copy, rebuild=False),
        )
    # auto never fails because of it (eager on CPU anyway)
    assert (
        make_runner(
            engine.model, engine.device, 4096, True, "auto", CompileOptions(cache_dir=cache_copy)
        ).backend_name
        == "eager"
    )
    # rebuilding on: rebuilt once, then a verified hit
    build, calls = _stub_builder(good_pkg)
    entry = cache.get_or_build(slot, plat, build, rebuild=True)
    assert len(calls) == 1 and entry.meta["platform"] == plat
    assert cache.lookup(slot, plat).path == entry.path


def test_missing_artifact(engine_for, tmp_path):
    engine = engine_for("qwen2")
    with pytest.raises(ArtifactError, match="boundgen compile"):
        make_runner(
            engine.model,
            engine.device,
            4096,
            True,
            "aoti",
            CompileOptions(buckets=None, cache_dir=tmp_path),
        )
    with pytest.raises(ValueError, match="unknown backend"):
        make_runner(engine.model, engine.device, 4096, True, "fast")
    with pytest.raises(ValueError, match="CUDA"):
        make_runner(engine.model, engine.device, 4096, True, "eager+graphs")


def test_graph_max_tokens_reaches_the_backend(tiny_model, monkeypatch):
    """`--graph-max-tokens` (an engine option) is the backend's limit for captured buckets; without
    it compiled buckets and eager ones have their own defaults, and a limit below one token is
    refused by name."""
    import boundgen.engine as engine_mod
    from boundgen import Engine

    seen = {}

    def fake_make_runner(model, device, budget, share, backend, options):
        seen["options"] = options
        return ModelRunner(model, device, None, budget, share)

    monkeypatch.setattr(engine_mod, "make_runner", fake_make_runner)
    Engine.from_pretrained(tiny_model("qwen2"), device="cpu", graph_max_tokens=16384)
    assert seen["options"].graph_max_tokens == 16384
    assert seen["options"].graph_limit("eager") == seen["options"].graph_limit("aoti") == 16384
    Engine.from_pretrained(tiny_model("qwen2"), device="cpu")
    assert seen["options"].graph_max_tokens is None  # each backend's own default
    assert seen["options"].graph_limit("eager") == EAGER_GRAPH_MAX_TOKENS
    assert seen["options"].graph_limit("compile") == COMPILED_GRAPH_MAX_TOKENS
    assert seen["options"].graph_limit("aoti") == COMPILED_GRAPH_MAX_TOKENS
    monkeypatch.undo()
    model = Engine.from_pretrained(tiny_model("qwen2"), device="cpu").model
    options = CompileOptions(graph_max_tokens=0)
    with pytest.raises(ValueError, match="graph_max_tokens must be at least 1"):
        make_runner(model, torch.device("cpu"), 4096, True, "eager+graphs", options)


def test_model_change_is_a_different_slot(engine_for):
    a = engine_for("qwen2").model
    b = engine_for("qwen3").model
    half = copy.deepcopy(a).to(torch.bfloat16)
    slots = [aoti_slots(m, torch.device("cpu"), [BUCKET], "none")[0] for m in (a, b, half)]
    assert len({s.key for s in slots}) == 3
    assert aoti_slots(a, torch.device("cpu"), [BUCKET], "fp8-mlp")[0].key != slots[0].key


def test_a_changed_kernel_makes_artifacts_stale(engine_for, cache_copy, tmp_path, monkeypatch):
    """A package embeds the Triton kernels it was built with: after an upgrade that changes one,
    the cached package (still the old kernel) is stale, not a hit."""
    engine = engine_for("qwen2")
    (slot,) = aoti_slots(engine.model, engine.device, [BUCKET], "none")
    cache = ArtifactCache(cache_copy)
    assert cache.lookup(slot, platform_info(engine.device)).path.is_file()
    kernel = tmp_path / "pkg" / "some_kernel.py"
    kernel.parent.mkdir()
    kernel.write_text("KERNEL = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mods = ("boundgen.attention.segments", "pkg.some_kernel")
    before = cache_mod.kernels_digest(mods)
    kernel.write_text("KERNEL = 2\n")
    assert cache_mod.kernels_digest(mods) != before
    monkeypatch.setattr(cache_mod, "kernels_digest", lambda modules: "another-kernel")
    with pytest.raises(ArtifactError, match="kernels") as err:
        cache.lookup(slot, platform_info(engine.device))
    assert err.value.kind == "stale"


def test_the_few_row_kernels_key_only_the_packages_that_embed_them(monkeypatch):
    """The streamed few-row kernels' source is part of the key only where the layers take them:
    an edit of one leaves every package built with it off valid."""
    from boundgen.models import stream, stream_gated, stream_qkv

    monkeypatch.setattr(stream, "MAX_ROWS", 0)
    monkeypatch.setattr(stream_gated, "GATED", False)
    monkeypatch.setattr(stream_qkv, "ROTATED", False)
    embedded = cache_mod.embedded_kernel_modules()
    assert "boundgen.models.stream" not in embedded
    off = platform_info("cpu")
    assert "stream_max_rows" not in off  # the keys of the packages built before it
    # the streaming GEMM: its source and its rows
    monkeypatch.setattr(stream, "MAX_ROWS", 64)
    embedded = cache_mod.embedded_kernel_modules()
    assert "boundgen.models.stream" in embedded
    assert platform_info("cpu")["stream_max_rows"] == "64"
    assert platform_info("cpu")["kernels"] != off["kernels"]
    # gate_up with SiLU·mul: its source and a key of its own only where it is on
    assert "boundgen.models.stream_gated" not in embedded
    assert "stream_gated" not in platform_info("cpu")
    monkeypatch.setattr(stream_gated, "GATED", True)
    assert "boundgen.models.stream_gated" in cache_mod.embedded_kernel_modules()
    assert platform_info("cpu")["stream_gated"] == "1"
    # qkv with the rotation: the same, its own key
    assert "boundgen.models.stream_qkv" not in cache_mod.embedded_kernel_modules()
    monkeypatch.setattr(stream_qkv, "ROTATED", True)
    assert "boundgen.models.stream_qkv" in cache_mod.embedded_kernel_modules()
    assert platform_info("cpu")["stream_qkv"] == "1"
    monkeypatch.setattr(stream, "MAX_ROWS", 0)  # streaming off: nothing takes them
    embedded = cache_mod.embedded_kernel_modules()
    assert "boundgen.models.stream_gated" not in embedded
    assert "boundgen.models.stream_qkv" not in embedded
    assert "stream_gated" not in platform_info("cpu")
    assert "stream_qkv" not in platform_info("cpu")


# -- libstdc++ preload guard
# ---------------------------------------------------------------------------
def _fake_probe(lib):
    """A 'load' that segfaults unless LD_PRELOAD contains `lib` (what the GPU image does)."""
    code = (
        "import os, signal, sys\n"
        f"if {lib!r} not in os.environ.get('LD_PRELOAD', '').split(): os.kill(os.getpid(), "
        "signal.SIGSEGV)\n"
        "print('boundgen-probe-ok')\n"
    )
    return [sys.executable, "-c", code]


def test_preload_detected_and_applied(tmp_path, monkeypatch):
    lib = preload.libstdcxx_candidates()[0] if preload.libstdcxx_candidates() else None
    if lib is None:
        pytest.skip("no system libstdc++ found")
    monkeypatch.setattr(preload, "loaded_libstdcxx", lambda: None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("BOUNDGEN_AOTI_REEXECED", raising=False)
    monkeypatch.delenv("BOUNDGEN_AOTI_PRELOAD", raising=False)
    monkeypatch.delenv("BOUNDGEN_AOTI_REEXEC", raising=False)
    ok, detail = preload.probe("unused", command=_fake_probe(lib))
    assert not ok and "signal 11" in detail
    result = preload.diagnose("unused", tmp_path, command=_fake_probe(lib))
    assert result["status"] == "preload" and result["preload"] == lib
    # the library path refuses rather than crashing the caller
    with pytest.raises(preload.AOTIUnsafe, match="LD_PRELOAD"):
        preload.ensure_loadable("unused", tmp_path, allow_reexec=False)
    # CLI entry points re-exec (cached diagnosis: no probe)
    execs = []
    monkeypatch.setattr(
        preload.os, "execve", lambda exe, argv, env: execs.append(env["LD_PRELOAD"])
    )
    preload.reexec_if_needed(tmp_path)
    assert execs == [lib]
    monkeypatch.setenv("BOUNDGEN_AOTI_PRELOAD", "off")
    preload.reexec_if_needed(tmp_path)
    assert len(execs) == 1


def test_preload_verdict_describes_a_process_started_by_hand(tmp_path, monkeypatch):
    """A compile run under LD_PRELOAD (as the benchmark scripts do) still finds that a process
    started without it crashes, and the verdict it stores is the one a server started by hand
    reads."""
    lib = preload.libstdcxx_candidates()[0] if preload.libstdcxx_candidates() else None
    if lib is None:
        pytest.skip("no system libstdc++ found")
    monkeypatch.setattr(preload, "loaded_libstdcxx", lambda: None)
    monkeypatch.setenv("LD_PRELOAD", lib)
    result = preload.diagnose("unused", tmp_path, command=_fake_probe(lib))
    assert result["status"] == "preload" and result["preload"] == lib
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.delenv("BOUNDGEN_AOTI_PRELOAD", raising=False)
    monkeypatch.setenv("BOUNDGEN_AOTI_REEXEC", "1")
    monkeypatch.delenv("BOUNDGEN_AOTI_REEXECED", raising=False)
    execs = []
    monkeypatch.setattr(
        preload.os, "execve", lambda exe, argv, env: execs.append(env["LD_PRELOAD"])
    )
    preload.reexec_if_needed(tmp_path)  # no probe: the stored verdict
    assert execs == [lib]


def test_preload_broken_and_ok(tmp_path):
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    assert preload.diagnose("unused", None, command=crash)["status"] == "broken"
    fine = [sys.executable, "-c", "print('boundgen-probe-ok')"]
    assert preload.diagnose("unused", tmp_path, command=fine)["status"] == "ok"
    assert preload.ensure_loadable("unused", tmp_path)["status"] == "ok"  # cached: no probe


def test_a_crashing_probe_writes_no_core_file():
    """A crash is one of the probe's expected answers: its child may not dump core."""
    check = "import resource; assert resource.getrlimit(resource.RLIMIT_CORE)[0] == 0; "
    command = [sys.executable, "-c", check + "print('boundgen-probe-ok')"]
    limit = resource.getrlimit(resource.RLIMIT_CORE)
    if limit[1] == 0:
        pytest.skip("core files are off for this user: nothing to prove")
    resource.setrlimit(resource.RLIMIT_CORE, (limit[1], limit[1]))  # a parent that allows cores
    try:
        assert preload.probe("unused", command=command) == (True, "ok")
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, limit)


def test_real_package_probe_loads(engine_for, aoti_cache):
    engine = engine_for("qwen2")
    (slot,) = aoti_slots(engine.model, engine.device, [BUCKET], "none")
    ok, detail = preload.probe(ArtifactCache(aoti_cache).dir_for(slot) / "package.pt2")
    assert ok, detail


def test_chunks_resplit_to_fit_buckets(engine_for):
    """A chunk larger than every bucket is cut at the largest bucket when all pieces then fit, in
    `rows` and so in the runtime's forward node (both pack through `runner.pieces`)."""
    engine = engine_for("qwen2")
    buckets = parse_buckets(["t64-s8-m64-g2-p32-q16", "t128"])
    forwards = CompiledForwards("compile", buckets, _eager_fns(engine.model, buckets), True)
    runner = ModelRunner(engine.model, engine.device, forwards)
    g = torch.Generator().manual_seed(5)
    plain = [SequenceGroup([], [_ids(g, 50) for _ in range(9)])]
    with torch.inference_mode():
        torch.testing.assert_close(runner.rows(plain), engine.runner.rows(plain))
    s = runner.stats()
    assert s["misses"] == 0 and s["batches"] == {"t128-s4-m128": 5}
    # a shared prefix longer than any bucket's P: runs eagerly (counted), never split into 9
    # forwards
    shared = [SequenceGroup(_ids(g, 100), [_ids(g, 5) for _ in range(9)])]
    with torch.inference_mode():
        torch.testing.assert_close(runner.rows(shared), engine.runner.rows(shared))
    assert runner.stats()["misses"] == 1
    # under the token budget, cut into bucket-sized pieces
    pieces = [packed for _, packed in runner.pieces(plain, ["last"] * 9)]
    assert [p.num_tokens for p in pieces] == [128] * 5
    assert [sum(p.rows_per_group) for p in pieces] == [2] * 4 + [1]
    assert len(list(runner.pieces(shared, ["last"] * 9))) == 1
    # through the runtime's forward node: same rows, every piece run by its bucket
    compiled = engine.with_runner(runner)
    texts = [_ids(g, 50) for _ in range(9)]
    try:
        before = runner.stats()["batches"]["t128-s4-m128"]
        got = compiled.embed(texts)
        assert runner.stats()["batches"]["t128-s4-m128"] == before + 5
    finally:
        compiled.close()
    torch.testing.assert_close(got, engine.embed(texts))


def test_compile_cli_check(tiny_model, aoti_cache, capsys):
    from boundgen.cli import main

    argv = [
        "compile",
        "--model",
        str(tiny_model("qwen2")),
        "--dtype",
        "float32",
        "--cache-dir",
        str(aoti_cache),
        "--check",
        "--buckets",
    ]
    assert main(argv + [BUCKET.name]) == 0
    assert "hit" in capsys.readouterr().out
    assert main(argv + [f"{BUCKET.name},t32"]) == 1
    assert "missing" in capsys.readouterr().out


@pytest.mark.slow
def test_an_interrupted_compile_keeps_what_it_finished(tiny_model, tmp_path, monkeypatch, capsys):
    """`boundgen compile` stopped in its second bucket: the first bucket and the load check's
    verdict (started with the first package) are in the cache, and the next compile finds the
    bucket (Inductor's ISA verdicts are stored check by check: test_compile_isa.py)."""
    from boundgen.cli import main
    from boundgen.compile import backends

    cache = tmp_path / "cache"
    real = backends.build_aoti
    built = []

    def build_then_stop(model, device, buckets, *args, **kwargs):
        if built:  # the second bucket: wait for the load check of the first, then stop
            for _ in range(600):
                if (cache / "preload-probe.json").exists():
                    break
                time.sleep(0.1)
            raise KeyboardInterrupt
        built.append(buckets[0].name)
        return real(model, device, buckets, *args, **kwargs)

    monkeypatch.setattr(backends, "build_aoti", build_then_stop)
    argv = ["compile", "--model", str(tiny_model("qwen2")), "--dtype", "float32"]
    argv += ["--cache-dir", str(cache), "--jobs", "1", "--buckets", f"{BUCKET.name},t32"]
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    assert built == [BUCKET.name]
    verdict = json.loads((cache / "preload-probe.json").read_text())
    assert [v["status"] for v in verdict.values()] == ["ok"]
    monkeypatch.setattr(backends, "build_aoti", real)
    capsys.readouterr()
    assert main([*argv[:-1], BUCKET.name, "--check"]) == 0  # the finished bucket is a hit
    assert " hit " in capsys.readouterr().out


def _cpu_search_buckets(engine, buckets: list[str]):
    """Whole-search buckets over the engine's model on the CPU (the graph layout, no graphs)."""
    from boundgen.compile.decode import SearchGraphs

    model = engine.model
    return SearchGraphs(
        model, torch.device("cpu"), model.backend, parse_buckets(buckets), use_graphs=False
    )


@pytest.mark.parametrize("copy_in_graph", [False, True])
def test_search_buckets_equal_the_plain_search(engine_for, copy_in_graph, monkeypatch):
    """The whole-search buckets (the CUDA-graph layout, here run without graphs) give the plain
    search's results, across requests that reuse a bucket's buffers, with and without a trie, with
    padded prompt counts; `copy_in_graph`: the search itself copies its staged prompts in (what
    its graph's first node does, `staging.COPY_IN_GRAPH`)."""
    from boundgen.compile import staging
    from boundgen.workloads.trie import Trie

    monkeypatch.setattr(staging, "COPY_IN_GRAPH", copy_in_graph)
    engine = engine_for("qwen2")
    sg = _cpu_search_buckets(engine, ["t32-s8", "t64-s8"])
    trie = Trie.from_sequences([[5, 6, 7], [5, 6, 8], [5, 9, 10], [11, 12, 13]])
    g = torch.Generator().manual_seed(9)
    for lens in [(7, 12), (9, 5), (7, 12), (3,), (4, 4, 4)]:
        prompts = [_ids(g, k) for k in lens]
        for t in (None, trie):
            with torch.inference_mode():
                got = sg.run(prompts, 3, 3, t, (1,))
                want = engine.runner.beam_search(prompts, 3, 3, t, (1,))
            assert got is not None and torch.equal(got[0], want[0])
            torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    # two prompts and three pad to the same 4-prompt bucket; one prompt has its own
    assert {k[1] for k in sg.slots} == {1, 2, 4}
    assert sg.searches == 10  # every search above ran in a bucket
    # each search's prompts went in as one copy of its slot's staged buffer (one more each
    # when the slot was made: all padding), nothing allocated past the slot's two buffers
    slots = sg.slots.values()
    assert sum(s.inputs.copies for s in slots) == sg.searches + len(slots)
    assert all(s.inputs.allocations == 2 for s in slots)
    assert sg.run([_ids(g, 100)], 3, 3) is None  # no bucket fits → the caller's plain path


def test_sealed_search_graphs_make_nothing_new(engine_for):
    """After `seal()` (a server after its warm-up) no bucket is made: a search runs in the
    smallest made bucket that takes it, is cut across made buckets when none takes all its
    prompts, or falls to the plain path (counted) — and records no compile."""
    engine = engine_for("qwen2")
    sg = _cpu_search_buckets(engine, ["t32-s8", "t64-s8", "t128-s8"])
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for b in (1, 2):  # the warm-up: one prompt, two prompts of up to 12 tokens
            sg.run([_ids(g, 12) for _ in range(b)], 3, 3)
    made = set(sg.slots)
    assert {(k[0].tokens, k[1]) for k in made} == {(32, 1), (32, 2)}
    assert sg.largest_made(3, 3, None) is None  # not sealed: no cap yet
    sg.seal()
    # what a merging caller caps a search at: the largest made graph of this width and steps
    assert sg.largest_made(3, 3, None) == 2
    assert sg.largest_made(2, 3, None) is None and sg.largest_made(3, 3, None, (1,)) is None
    before = COMPILES.total()
    for lens in [(5,), (12, 3), (7, 7, 7), (12, 12, 12, 12, 12)]:
        prompts = [_ids(g, k) for k in lens]
        with torch.inference_mode():
            got = sg.run(prompts, 3, 3)
            want = engine.runner.beam_search(prompts, 3, 3)
        assert got is not None and torch.equal(got[0], want[0])  # 3 and 5 prompts: cut
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    assert set(sg.slots) == made and COMPILES.total() == before
    assert sg.searches == 2 + 1 + 1 + 2 + 3 and sg.misses == 0
    # a prompt longer than any made bucket takes, and another width: plain path, counted
    assert sg.run([_ids(g, 40)], 3, 3) is None
    assert sg.run([_ids(g, 5)], 2, 3) is None
    assert sg.misses == 2 and set(sg.slots) == made and COMPILES.total() == before


def test_search_replicas_serve_callers_at_once(engine_for, caplog):
    """Whole-search graph replicas (one per concurrent stream; on the CPU one per calling
    thread): a warm-up on one caller makes each bucket in every replica, so after sealing a
    second caller (bound to the other replica) finds its bucket made, and callers searching at
    the same time get the plain search's results."""
    from concurrent.futures import ThreadPoolExecutor

    from boundgen.compile.search_streams import SearchStreams, search_graphs

    engine = engine_for("qwen2")
    model = engine.model
    sg = SearchStreams(
        model,
        torch.device("cpu"),
        model.backend,
        2,
        prompt_buckets=parse_buckets(["t32-s8"]),
        use_graphs=False,
    )
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        sg.run([_ids(g, 9), _ids(g, 6)], 3, 3)  # the warm-up, on this thread
        made = sg.replicas[1].searches
        sg.run([_ids(g, 4), _ids(g, 7)], 3, 3)  # a bucket made everywhere: this replica only
    assert sg.replicas[1].searches == made
    sg.seal()
    assert all(set(r.slots) == set(sg.slots) for r in sg.replicas) and len(sg.slots) == 1
    requests = [[_ids(g, k), _ids(g, 12 - k)] for k in range(2, 10)]

    def one(prompts):
        with torch.inference_mode():
            return sg.run(prompts, 3, 3), engine.runner.beam_search(prompts, 3, 3)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, requests))
    for got, want in results:
        assert got is not None and torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    assert sg.misses == 0 and sg.replicas[1].searches > 1  # the first pool thread: replica 1
    assert sg.largest_made(3, 3, None) == 2
    # a width never warmed: the plain path, counted on each replica, named in one WARNING
    with caplog.at_level(logging.WARNING, logger="boundgen"), torch.inference_mode():
        assert [r.run(requests[0], 2, 3) for r in sg.replicas] == [None, None]
    assert sg.misses == 2
    assert sum("no whole-search graph" in m.getMessage() for m in caplog.records) == 1
    # one stream, or the CPU: the plain whole-search graphs; a count below one is refused
    assert not isinstance(
        search_graphs(model, "cpu", model.backend, False, streams=2), SearchStreams
    )
    with pytest.raises(ValueError, match="BOUNDGEN_BEAM_STREAMS"):
        search_graphs(model, "cpu", model.backend, False, streams=0)


@pytest.mark.slow
def test_compiled_search_layers_equal_the_plain_search(engine_for):
    """Prefill and decode layers through torch.compile (one compiled graph each for every layer and
    step) give the plain search's results."""
    from boundgen.compile.aoti import export_attention
    from boundgen.compile.decode import SearchGraphs

    engine = engine_for("qwen2")
    model = engine.model
    sg = SearchGraphs(
        model,
        torch.device("cpu"),
        export_attention(model, "cpu"),
        parse_buckets(["t32-s8", "t64-s8"]),
        compile_layers=True,
        use_graphs=False,
    )
    g = torch.Generator().manual_seed(3)
    watch_dynamo()
    before = COMPILES.total(TORCH_COMPILE)
    # buckets of other prompt tokens (t32, t64) and rows (B·W = 8, 4, 16): the layers are compiled
    # with dynamic rows, so new buckets do not compile again (each function: once, then once more
    # when its max-length ints turn dynamic)
    for lens in [(7, 11), (3,), (20, 20, 9)]:
        prompts = [_ids(g, k) for k in lens]
        with torch.inference_mode():
            got = sg.run(prompts, 4, 3)
            want = engine.runner.beam_search(prompts, 4, 3)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
    assert {k[0].tokens for k in sg.slots} == {32, 64}
    assert COMPILES.total(TORCH_COMPILE) - before <= 4


class _FrameError(RuntimeError):
    """What a deep compile error can look like: it holds a frame, which cannot be pickled."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.frame = sys._getframe()


def test_a_build_workers_error_comes_back_as_itself(monkeypatch):
    """A worker's build error reaches the parent as its own type, message and traceback, not as
    the pool's "cannot pickle 'frame' object" (which hid the H200's t16384 failure)."""
    import pickle

    from boundgen.compile import backends, parallel

    def fail(*args, **kwargs):
        raise _FrameError("the lowering ran out of something")

    monkeypatch.setattr(backends, "build_aoti", fail)
    monkeypatch.setattr(parallel, "_WORKER", {"model": None, "device": torch.device("cpu")})
    with pytest.raises(TypeError, match="pickle"):
        pickle.dumps(_FrameError("x"))
    row = pickle.loads(pickle.dumps(parallel._build_one(BUCKET.name, None, "none", True, False)))
    assert row["bucket"] == BUCKET.name and row["event"] == "error"
    assert row["error"] == "_FrameError: the lowering ran out of something"
    assert any("in fail" in line for line in row["traceback"])


def test_a_bucket_whose_worker_failed_is_built_again_here(
    tiny_model, tmp_path, monkeypatch, capsys
):
    """`boundgen compile` with workers: a bucket whose worker build failed is built once more in
    the command's own process; its row says so and keeps the first error, the other buckets are
    left as their workers built them, and the command succeeds."""
    from boundgen.cli import main
    from boundgen.commands import compile as compile_cmd
    from boundgen.compile import backends, parallel
    from boundgen.compile import preload as preload_mod

    package = tmp_path / "package.pt2"
    package.write_bytes(b"")

    def built(name: str) -> dict:
        return {"bucket": name, "event": "built", "path": str(package), "size_bytes": 1}

    class Workers:  # the parallel build: t32 built, the other bucket failed
        def results(self, on_done=None):
            rows = [parallel.failed(BUCKET.name, _FrameError("worker lost it")), built("t32")]
            for row in rows:
                on_done(row)
            return rows

        def cancel(self):
            raise AssertionError("not cancelled: the build went on")

    here = []

    def build_here(model, device, buckets, *args, **kwargs):
        here.append(buckets[0].name)
        return [(buckets[0], None, built(buckets[0].name))]

    monkeypatch.setattr(compile_cmd, "_jobs", lambda requested, buckets: 2)
    monkeypatch.setattr(compile_cmd, "_start_workers", lambda *a: Workers())
    monkeypatch.setattr(backends, "build_aoti", build_here)
    monkeypatch.setattr(preload_mod, "diagnose", lambda package, root: None)
    out = tmp_path / "compile.json"
    argv = ["compile", "--model", str(tiny_model("qwen2")), "--dtype", "float32", "--no-verify"]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--buckets", f"{BUCKET.name},t32"]
    assert main([*argv, "--json", str(out)]) == 0
    assert here == [BUCKET.name]
    rows = json.loads(out.read_text())["rows"]
    assert [r["event"] for r in rows] == ["built", "built"]
    assert rows[0]["first_try"]["error"] == "_FrameError: worker lost it"
    assert "first_try" not in rows[1]
    captured = capsys.readouterr()
    # said as it happens (on stderr, beside the progress bar), so a run cut short still says why
    failed = "build failed (built again in this process after the others): _FrameError: worker"
    assert f"{BUCKET.name}: {failed} lost it" in captured.err
    printed = captured.out
    assert f"{BUCKET.name}: tried again in this process after its build worker failed: " in printed
    assert "_FrameError: worker lost it" in printed
    assert "2/2 buckets ready" in printed


def test_parallel_workers_build_the_slots_the_fp8_engine_looks_up(
    tiny_model, tmp_path, monkeypatch
):
    """`boundgen compile --fp8 P --jobs N`: each worker swaps the same projections as the engine
    that will serve, so its artifact slots are the ones that engine asks the cache for."""
    from boundgen import Engine
    from boundgen.compile import parallel

    monkeypatch.setenv("BOUNDGEN_FP8_GATE_CACHE", str(tmp_path / "gate.json"))
    path = tiny_model("qwen2")
    engine = Engine.from_pretrained(path, fp8="MLP", fp8_emulate=True, fp8_force=True)
    monkeypatch.setattr(parallel, "_WORKER", {})
    parallel._init(str(path), "cpu", None, engine.engine_config.attention, "mlp", True)
    worker = parallel._WORKER["model"]
    served = aoti_slots(engine.model, engine.device, [BUCKET], "mlp")[0]
    built = aoti_slots(worker, torch.device("cpu"), [BUCKET], "mlp")[0]
    plain_model = Engine.from_pretrained(path).model
    plain = aoti_slots(plain_model, engine.device, [BUCKET], "none")[0]
    assert built.key == served.key != plain.key


def test_compile_reads_the_serve_config_files_engine_settings(tmp_path):
    """`boundgen compile --config FILE` builds for the engine settings of the file a server runs
    with (an FP8 policy forced on an unchecked checkpoint, say), flags over them."""
    from boundgen.cli import build_parser
    from boundgen.commands.compile import _engine_config

    config = tmp_path / "serve.yaml"
    config.write_text("fp8: mlp\nfp8_force: true\ndtype: bfloat16\nport: 9000\n")
    args = build_parser().parse_args(["compile", "--config", str(config), "--dtype", "float32"])
    cfg = _engine_config(args)
    assert (cfg.fp8, cfg.fp8_force, cfg.dtype) == ("mlp", True, "float32")
    plain = _engine_config(build_parser().parse_args(["compile"]))
    assert (plain.fp8, plain.fp8_force) == ("none", False)


def test_a_finer_ladder_pads_searches_to_its_sizes(engine_for, monkeypatch):
    """With the finer ladder three prompts run as three (not four) and give the plain search's
    results; the warm-up makes every size of the ladder up to its count."""
    from boundgen import warmup
    from boundgen.compile import decode

    monkeypatch.setattr(decode, "BATCH_SIZES", decode.batch_sizes("1,2,3,4,6,8"))
    monkeypatch.setattr(warmup, "BATCH_SIZES", decode.BATCH_SIZES)
    engine = engine_for("qwen2")
    sg = _cpu_search_buckets(engine, ["t32-s8"])
    g = torch.Generator().manual_seed(5)
    prompts = [_ids(g, 6) for _ in range(3)]
    with torch.inference_mode():
        got = sg.run(prompts, 3, 3)
        want = engine.runner.beam_search(prompts, 3, 3)
    assert torch.equal(got[0], want[0]) and {k[1] for k in sg.slots} == {3}
    entry = {"kind": "beam", "prompt_tokens": 8, "width": 2, "steps": 2, "count": 5}
    made = [what for what, _ in warmup.requests(engine, [entry])]
    assert [w.split("x")[0] for w in made] == ["beam 1", "beam 2", "beam 3", "beam 4", "beam 6"]


def test_beam_batch_size_ladder_parses_and_rejects_bad_lists():
    """`BOUNDGEN_BEAM_BATCH_SIZES`: ascending whole numbers from 1, else a clear error naming it."""
    from boundgen.compile.decode import BATCH_SIZES, batch_sizes

    assert BATCH_SIZES[0] == 1
    assert batch_sizes("1,2,3,4,6,8,12,16,24,32") == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    for bad in ("", "2,4", "1,4,4", "1,8,4", "1,two"):
        with pytest.raises(ValueError, match="BOUNDGEN_BEAM_BATCH_SIZES"):
            batch_sizes(bad)
