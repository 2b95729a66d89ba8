"""Built-in pipelines (score, classify, embed + MLP head, beam) over an `Engine`, and `EngineRuntime`.

Each pipeline is the workload's stages as nodes:

    score:    prepare (CPU: tokenize → SequenceGroups) → forward (batching, DEVICE) → head (DEVICE:
    label
              columns of the LM head) → finish (CPU: softmax, lists)
    classify: prepare → forward → head (score head) → finish embed:    prepare → forward (last or
    mean pooling) → mlp_head (DEVICE: normalize, optional MLP head)
    beam:     prepare → beam (batching, DEVICE: prefill + S decode steps) → finish

`forward` is one `BatchingNode` shared by score, classify and embed: concurrent requests of any of
the three are packed into one padding-free forward (within the token budget), and each gets its rows
back in order. Input validation errors raise `ValueError` unchanged (the server answers 4xx); other
node failures raise
`NodeError`, deadlines `DeadlineExceeded`.

`EngineRuntime` owns an `Executor` and these pipelines; the server and `Engine` call it:

    rt = EngineRuntime(engine, max_wait_ms=1.0)
    rt.run("score", ScoreRequest(query, items, [yes, no]), timeout_ms=20)
    fut = rt.submit("embed", EmbedRequest(texts), timeout_ms=20)
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from boundgen.runtime.batching import BatchingNode
from boundgen.runtime.dag import Pipeline
from boundgen.runtime.executor import Executor
from boundgen.runtime.memory import Lease, MemoryPools
from boundgen.runtime.node import Node, NodeKind
from boundgen.workloads.runner import mean_rows

if TYPE_CHECKING:  # the runtime sits above workloads; engine is imported only for types
    from boundgen.engine import Engine

KINDS = ("score", "classify", "embed", "beam")


# ---- staging a PackedBatch through pooled pinned / device buffers
# ---------------------------------------


_ALIGN_BYTES = 16


def stage_packed(batch: Any, lease: Lease, device: torch.device) -> Any:
    """Move a CPU `PackedBatch` to `device` with two copies: every int64 tensor through one pooled pinned
    buffer into one pooled device buffer (bucketed size), the same for the int32 attention offsets."""
    from boundgen.text.packing import PackedBatch

    if device.type == "cpu":
        return batch
    attn = batch.attn
    longs = [batch.input_ids, batch.positions, batch.last_index, batch.seq_start, batch.seq_len]
    ints = [t for t in (attn.cu_seqlens, attn.cu_prefix, attn.cu_group_q) if t is not None]
    l_dev = _stage_many(longs, torch.int64, lease)
    i_dev = _stage_many(ints, torch.int32, lease)
    it = iter(i_dev)
    cu_seqlens = next(it)
    cu_prefix = next(it) if attn.cu_prefix is not None else None
    cu_group_q = next(it) if attn.cu_group_q is not None else None
    new_attn = dataclasses.replace(
        attn, cu_seqlens=cu_seqlens, cu_prefix=cu_prefix, cu_group_q=cu_group_q
    )
    return PackedBatch(*l_dev[:2], new_attn, *l_dev[2:], list(batch.rows_per_group))


def _stage_many(
    tensors: list[torch.Tensor], dtype: torch.dtype, lease: Lease
) -> list[torch.Tensor]:
    # NOTE: every view starts on a 16-byte boundary: compiled kernels (AOTInductor) assume aligned
    # inputs and otherwise copy the tensor on every call (and warn each time).
    step = max(1, _ALIGN_BYTES // dtype.itemsize)
    sizes = [t.numel() for t in tensors]
    starts, off = [], 0
    for n in sizes:
        starts.append(off)
        off += -(-n // step) * step
    total = off
    rows = lease.pools.bucket(total)
    host = lease.host(rows, dtype)
    for t, start, n in zip(tensors, starts, sizes):
        host[start : start + n].copy_(t.reshape(-1))
    dev = lease.device(rows, dtype)
    dev[:total].copy_(host[:total], non_blocking=True)
    return [dev[start : start + n].view(t.shape) for t, start, n in zip(tensors, starts, sizes)]


class _Forward:
    """The shared model node: packs SequenceGroups of many requests, runs the model, pools rows per request.

    Pooled staging buffers of a batch are returned once the batch's device work is done (an event
    per
    batch on CUDA; immediately on CPU)."""

    def __init__(self, engine: Engine, pools: MemoryPools):
        self.engine = engine
        self.pools = pools
        self._pending: deque[tuple[Any, Lease]] = deque()
        self._lock = threading.Lock()

    @staticmethod
    def merge(items: list[dict[str, Any]]) -> tuple[tuple[list, list[str]], list[int]]:
        groups: list = []
        pooling: list[str] = []
        sizes: list[int] = []
        for it in items:
            n = 0
            for g in it["groups"]:
                groups.append(g)
                n += len(g.suffixes)
            pooling += [it["pooling"]] * n
            sizes.append(n)
        return (groups, pooling), sizes

    @staticmethod
    def split(rows: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return list(torch.split(rows, sizes))

    @staticmethod
    def size(inputs: dict[str, Any]) -> int:
        return sum(g.num_tokens for g in inputs["groups"])

    def _reclaim(self) -> None:
        with self._lock:
            while self._pending and self._pending[0][0].query():
                self._pending.popleft()[1].release_all()

    def __call__(self, batch: tuple[list, list[str]]) -> torch.Tensor:
        groups, pooling = batch
        runner = self.engine.runner
        device = runner.device
        cuda = device.type == "cuda"
        if cuda:
            self._reclaim()
        lease = Lease(self.pools)
        outs = []
        row = 0
        try:
            with torch.inference_mode():
                for chunk in runner.split(groups):
                    chunk_rows = sum(len(g.suffixes) for g in chunk)
                    share = runner.share_prefix and "mean" not in pooling[row : row + chunk_rows]
                    for packed in runner.pack_chunk(chunk, share):
                        n = sum(packed.rows_per_group)
                        modes = pooling[row : row + n]
                        row += n
                        packed = stage_packed(packed, lease, device)
                        hidden = runner.forward(packed)
                        last = hidden.index_select(0, packed.last_index)
                        if "mean" in modes:
                            mask = torch.tensor([m == "mean" for m in modes], device=device)
                            idx = mask.nonzero().squeeze(1)
                            last[idx] = mean_rows(
                                hidden, packed.seq_start[idx], packed.seq_len[idx]
                            )
                        outs.append(last)
                rows = torch.cat(outs) if len(outs) > 1 else outs[0]
        finally:
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
                with self._lock:
                    self._pending.append((ev, lease))
            else:
                lease.release_all()
        return rows


class _Beam:
    """The beam node: requests with the same (width, steps, trie) share one packed prefill + decode loop."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @staticmethod
    def merge(items: list[dict[str, Any]]) -> tuple[dict, list[tuple]]:
        by_key: dict[tuple, list[list[int]]] = {}
        sizes = []
        for it in items:
            req = it["request"]
            key = (req.beam_width, req.steps, id(req.trie) if req.trie is not None else None)
            prompts = by_key.setdefault(key, [])
            sizes.append((key, len(prompts), len(it["prompts"])))
            prompts.extend(it["prompts"])
        tries = {}
        for it in items:
            req = it["request"]
            if req.trie is not None:
                tries[id(req.trie)] = req.trie
        return {"groups": by_key, "tries": tries}, sizes

    def __call__(self, batch: dict) -> dict:
        from boundgen.workloads.beam import run_beam

        out = {}
        eos = self.engine.eos_token_ids()
        with torch.inference_mode():
            for key, prompts in batch["groups"].items():
                width, steps, trie_id = key
                trie = batch["tries"].get(trie_id) if trie_id is not None else None
                out[key] = run_beam(self.engine.runner, prompts, width, steps, trie, eos)
        return out

    @staticmethod
    def split(out: dict, sizes: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        parts = []
        for key, start, n in sizes:
            tokens, scores = out[key]
            parts.append((tokens[start : start + n], scores[start : start + n]))
        return parts

    @staticmethod
    def size(inputs: dict[str, Any]) -> int:
        req = inputs["request"]
        return (
            sum(len(p) for p in inputs["prompts"])
            + len(inputs["prompts"]) * req.beam_width * req.steps
        )


def build_pipelines(
    engine: Engine,
    pools: MemoryPools | None = None,
    token_budget: int | None = None,
    max_wait_ms: float = 0.0,
    max_batch_requests: int | None = None,
) -> dict[str, Pipeline]:
    """The built-in pipelines over `engine`, keyed by kind: score, classify, embed, beam.

    `token_budget` (default: the engine's `max_batch_tokens`) and `max_wait_ms` set the
    cross-request batching of the shared forward node and of the beam node.
    """
    from boundgen.workloads.beam import BeamBounds, BeamRequest, finish_beam, prepare_beam
    from boundgen.workloads.classify import ClassifyRequest, finish_classify, prepare_texts
    from boundgen.workloads.embed import EmbedRequest, MLPHead, finish_embed
    from boundgen.workloads.score import ScoreRequest, finish_score, prepare_score

    pools = pools or MemoryPools(engine.device)
    budget = token_budget or engine.engine_config.max_batch_tokens
    tokenizer, limits = engine.tokenizer, engine.limits
    runner = engine.runner
    bounds = BeamBounds(engine.engine_config.max_beam_width, engine.engine_config.max_beam_steps)
    fwd = _Forward(engine, pools)
    forward = BatchingNode(
        "forward",
        fwd,
        inputs={"groups": list, "pooling": str},
        outputs={"rows": torch.Tensor},
        merge=fwd.merge,
        split=fwd.split,
        size=fwd.size,
        token_budget=budget,
        max_wait_ms=max_wait_ms,
        max_batch=max_batch_requests,
    )

    def cpu(
        fn: Any, name: str, inputs: dict[str, Any], outputs: dict[str, Any], raises: tuple = ()
    ) -> Node:
        return Node(name, fn, inputs=inputs, outputs=outputs, kind=NodeKind.CPU, raises=raises)

    def device(fn: Any, name: str, inputs: dict[str, Any], outputs: dict[str, Any]) -> Node:
        def run(**kw: Any) -> Any:
            with torch.inference_mode():
                return fn(**kw)

        return Node(name, run, inputs=inputs, outputs=outputs, kind=NodeKind.DEVICE)

    # score
    def score_head(rows: torch.Tensor, request: ScoreRequest, ctx: Any) -> torch.Tensor:
        # label columns through a pinned pooled buffer: no pageable (blocking) host-to-device copy
        cols = torch.tensor(request.label_token_ids, dtype=torch.int64)
        if rows.device.type == "cuda":
            cols = ctx.lease.stage(cols)
        with torch.inference_mode():
            return engine.model.head(rows, cols)

    def score_prepare(request: ScoreRequest) -> tuple[list, str]:
        engine._need_task("causal_lm", "score")
        return prepare_score(request, tokenizer, limits), "last"

    score = Pipeline(
        "score",
        {"request": ScoreRequest},
        [
            cpu(
                score_prepare,
                "prepare",
                {"request": ScoreRequest},
                {"groups": list, "pooling": str},
                (ValueError,),
            ),
            forward,
            Node(
                "head",
                score_head,
                inputs={"rows": torch.Tensor, "request": ScoreRequest},
                outputs={"label_logits": torch.Tensor},
                kind=NodeKind.DEVICE,
                wants_ctx=True,
            ),
            cpu(
                lambda label_logits, request: finish_score(label_logits, request),
                "finish",
                {"label_logits": torch.Tensor, "request": ScoreRequest},
                {"scores": list},
            ),
        ],
        ["scores"],
    )

    # classify
    def classify_prepare(request: ClassifyRequest) -> tuple[list, str]:
        engine._need_task("seq_cls", "classify")
        return prepare_texts(request.texts, tokenizer, limits, request.truncate), "last"

    classify = Pipeline(
        "classify",
        {"request": ClassifyRequest},
        [
            cpu(
                classify_prepare,
                "prepare",
                {"request": ClassifyRequest},
                {"groups": list, "pooling": str},
                (ValueError,),
            ),
            forward,
            device(
                lambda rows: runner.head(rows),
                "head",
                {"rows": torch.Tensor},
                {"logits": torch.Tensor},
            ),
            cpu(finish_classify, "finish", {"logits": torch.Tensor}, {"probs": list}),
        ],
        ["probs"],
    )

    # embed (+ MLP head node)
    def embed_prepare(request: EmbedRequest, head: Any) -> tuple[list, str, Any]:
        if request.pooling not in ("last", "mean"):
            raise ValueError(f"unknown pooling '{request.pooling}'; use 'last' or 'mean'")
        if head is not None and not isinstance(head, MLPHead):
            head = MLPHead.load(head)
        return (
            prepare_texts(request.texts, tokenizer, limits, request.truncate),
            request.pooling,
            head,
        )

    embed = Pipeline(
        "embed",
        {"request": EmbedRequest, "head": Any},
        [
            cpu(
                embed_prepare,
                "prepare",
                {"request": EmbedRequest, "head": Any},
                {"groups": list, "pooling": str, "mlp": Any},
                (ValueError, FileNotFoundError),
            ),
            forward,
            device(
                lambda rows, request, mlp: finish_embed(rows, request.normalize, mlp),
                "mlp_head",
                {"rows": torch.Tensor, "request": EmbedRequest, "mlp": Any},
                {"vectors": torch.Tensor},
            ),
        ],
        ["vectors"],
        defaults={"head": None},
    )

    # beam
    bm = _Beam(engine)
    beam_node = BatchingNode(
        "beam",
        bm,
        inputs={"request": BeamRequest, "prompts": list},
        outputs={"tokens": torch.Tensor, "beam_scores": torch.Tensor},
        merge=bm.merge,
        split=bm.split,
        size=bm.size,
        token_budget=budget,
        max_wait_ms=max_wait_ms,
        max_batch=max_batch_requests,
    )

    def beam_prepare(request: BeamRequest) -> list:
        engine._need_task("causal_lm", "beam search")
        return prepare_beam(request, tokenizer, limits, bounds)

    beam = Pipeline(
        "beam",
        {"request": BeamRequest},
        [
            cpu(
                beam_prepare, "prepare", {"request": BeamRequest}, {"prompts": list}, (ValueError,)
            ),
            beam_node,
            cpu(
                lambda tokens, beam_scores, request: finish_beam(
                    tokens, beam_scores, request.top_k or request.beam_width
                ),
                "finish",
                {"tokens": torch.Tensor, "beam_scores": torch.Tensor, "request": BeamRequest},
                {"results": list},
            ),
        ],
        ["results"],
    )
    return {"score": score, "classify": classify, "embed": embed, "beam": beam}


def _request_types() -> dict[str, type]:
    from boundgen.workloads.beam import BeamRequest
    from boundgen.workloads.classify import ClassifyRequest
    from boundgen.workloads.embed import EmbedRequest
    from boundgen.workloads.score import ScoreRequest

    return {
        "score": ScoreRequest,
        "classify": ClassifyRequest,
        "embed": EmbedRequest,
        "beam": BeamRequest,
    }


class EngineRuntime:
    """An `Engine` served through the DAG runtime: one executor, the built-in pipelines, user pipelines.

    `submit(kind, request, timeout_ms) -> Future` and `run(kind, request, timeout_ms)` take the
    workload's request dataclass (`ScoreRequest`, `ClassifyRequest`, `EmbedRequest`, `BeamRequest`)
    or a dict of its fields; extra keyword arguments are further pipeline inputs (`head=` for embed,
    or inputs of user nodes). The result is the pipeline's output: scores (list[list[float]]),
    probs, vectors (tensor [N, D]), or beam results (list per prompt of (tokens, logprob)). The
    Engine-style methods (`score`, `classify`,
    `embed`,
    `beam_search`, `beam_search_batch`) take the same arguments as `Engine`'s.
    """

    def __init__(
        self,
        engine: Engine,
        executor: Executor | None = None,
        cpu_workers: int | None = None,
        device_streams: int = 4,
        token_budget: int | None = None,
        max_wait_ms: float = 0.0,
        max_batch_requests: int | None = None,
        default_timeout_ms: float | None = None,
        trace_requests: int = 0,
    ) -> None:
        self.engine = engine
        self._own_executor = executor is None
        self.executor = executor or Executor(
            cpu_workers=cpu_workers,
            device_streams=device_streams,
            device=str(engine.device),
            default_timeout_ms=default_timeout_ms,
            trace_requests=trace_requests,
        )
        self.pipelines: dict[str, Pipeline] = build_pipelines(
            engine, self.executor.pools, token_budget, max_wait_ms, max_batch_requests
        )
        self._request_types = _request_types()
        self._lock = threading.Lock()

    # ---- generic
    # ------------------------------------------------------------------------------------------

    def register(self, kind: str, pipeline: Pipeline, replace: bool = False) -> None:
        """Serve `pipeline` under `kind` (e.g. `rt.pipelines["score"].extend(top_n)` as "rerank"). Its first
        input must be `request`; a new kind takes the request type of the built-in pipeline it extends."""
        if "request" not in pipeline.inputs:
            raise ValueError(
                f"pipeline {pipeline.name!r} has no 'request' input (inputs: {', '.join(pipeline.inputs)})"
            )
        with self._lock:
            if kind in self.pipelines and not replace:
                raise ValueError(f"a pipeline is already registered as {kind!r}; pass replace=True")
            self.pipelines = {**self.pipelines, kind: pipeline}

    def _inputs(
        self, kind: str, request: Any, extra: dict[str, Any]
    ) -> tuple[Pipeline, dict[str, Any]]:
        try:
            pipe = self.pipelines[kind]
        except KeyError:
            raise ValueError(
                f"unknown pipeline {kind!r}; known: {', '.join(sorted(self.pipelines))}"
            ) from None
        if isinstance(request, dict):
            rtype = pipe.inputs.get("request")
            if not isinstance(rtype, type) or not dataclasses.is_dataclass(rtype):
                raise ValueError(f"pipeline {kind!r} needs a request object, not a dict")
            fields = {f.name for f in dataclasses.fields(rtype)}
            # keys that are not request fields but are pipeline inputs (e.g. embed's `head`) go
            # there
            extra = {
                **{k: v for k, v in request.items() if k not in fields and k in pipe.inputs},
                **extra,
            }
            try:
                request = rtype(
                    **{k: v for k, v in request.items() if k in fields or k not in pipe.inputs}
                )
            except TypeError as exc:
                raise ValueError(f"bad {kind} request: {exc}") from None
        return pipe, {"request": request, **extra}

    def submit(
        self, kind: str, request: Any, timeout_ms: float | None = None, **inputs: Any
    ) -> Future:
        pipe, values = self._inputs(kind, request, inputs)
        return self.executor.submit(pipe, values, timeout_ms, unwrap=len(pipe.outputs) == 1)

    def run(self, kind: str, request: Any, timeout_ms: float | None = None, **inputs: Any) -> Any:
        pipe, values = self._inputs(kind, request, inputs)
        return self.executor.run(pipe, values, timeout_ms, unwrap=len(pipe.outputs) == 1)

    def stats(self) -> dict[str, Any]:
        out = self.executor.stats()
        out["batching"] = {
            p.node.name: p.node.stats()
            for pipe in self.pipelines.values()
            for p in pipe.plan
            if isinstance(p.node, BatchingNode)
        }
        return out

    def export_trace(self, path: str) -> str:
        return self.executor.tracer.export_chrome(path)

    def close(self) -> None:
        for pipe in self.pipelines.values():
            for p in pipe.plan:
                if isinstance(p.node, BatchingNode):
                    p.node.close()
        if self._own_executor:
            self.executor.close()

    def __enter__(self) -> EngineRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the Engine API, through the pipelines
    # -------------------------------------------------------------

    def score(
        self,
        query,
        items,
        label_token_ids,
        apply_softmax: bool = False,
        item_first: bool = False,
        truncate: bool = False,
        timeout_ms: float | None = None,
    ) -> list[list[float]]:
        req = self._request_types["score"](
            query, items, label_token_ids, apply_softmax, item_first, truncate
        )
        return self.run("score", req, timeout_ms)

    def classify(
        self, texts, truncate: bool = False, timeout_ms: float | None = None
    ) -> list[list[float]]:
        return self.run("classify", self._request_types["classify"](texts, truncate), timeout_ms)

    def embed(
        self,
        texts,
        pooling: str = "last",
        normalize: bool = False,
        head: Any = None,
        truncate: bool = False,
        timeout_ms: float | None = None,
    ) -> torch.Tensor:
        req = self._request_types["embed"](texts, pooling, normalize, truncate)
        return self.run("embed", req, timeout_ms, head=head)

    def beam_search_batch(
        self,
        prompts,
        beam_width: int,
        steps: int,
        top_k: int | None = None,
        trie=None,
        truncate: bool = False,
        timeout_ms: float | None = None,
    ) -> list[list[tuple[list[int], float]]]:
        req = self._request_types["beam"](prompts, beam_width, steps, top_k, trie, truncate)
        return self.run("beam", req, timeout_ms)

    def beam_search(
        self,
        prompt,
        beam_width: int,
        steps: int,
        top_k: int | None = None,
        trie=None,
        truncate: bool = False,
        timeout_ms: float | None = None,
    ) -> list[tuple[list[int], float]]:
        if not isinstance(prompt, str) and not (
            isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt)
        ):
            raise ValueError("prompt must be a string or a non-empty list of token ids")
        return self.beam_search_batch(
            [prompt], beam_width, steps, top_k, trie, truncate, timeout_ms
        )[0]
