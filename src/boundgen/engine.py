"""`Engine`: the Python API over a checkpoint (score, classify, embed, beam search).

Every call runs as a pipeline through the engine's one `EngineRuntime` (the same runtime the HTTP
server submits to), so concurrent calls from several threads are batched together and carry optional
deadlines (`timeout_ms`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import torch

from boundgen.compile.backends import CompileOptions
from boundgen.config import EngineConfig, ModelConfig
from boundgen.models.decoder import DecoderModel
from boundgen.models.loading import load_model, open_device
from boundgen.runner import ModelRunner, make_runner
from boundgen.text.tokenizer import Tokenizer
from boundgen.workloads.base import BeamBounds, WorkloadContext
from boundgen.workloads.beam import BeamRequest
from boundgen.workloads.classify import ClassifyRequest
from boundgen.workloads.embed import EmbedRequest, MLPHead
from boundgen.workloads.inputs import Limits
from boundgen.workloads.score import ScoreRequest
from boundgen.workloads.service import EngineRuntime
from boundgen.workloads.traffic import TrafficLog

log = logging.getLogger("boundgen")


class Engine:
    """A checkpoint served by one `ModelRunner` through one `EngineRuntime`. Build it with
    `Engine.from_pretrained`; `Engine(runner, tokenizer, config, path)` serves any runner (the HF
    baseline server passes one over transformers)."""

    def __init__(
        self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig, model_path: Path
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.engine_config = config
        self.model_path = Path(model_path)
        mc = runner.config
        # The checkpoint's own name (HF `_name_or_path`) when it has one, else its directory's name.
        self.model_name = Path(mc.extra.get("_name_or_path") or self.model_path.name).name
        self.limits = Limits(
            vocab_size=mc.vocab_size,
            max_seq_len=min(
                config.max_seq_len or mc.max_position_embeddings, mc.max_position_embeddings
            ),
            max_items=config.max_items,
        )
        self._runtime: EngineRuntime | None = None
        self._traffic: TrafficLog | None = None
        self._runtime_lock = threading.RLock()  # the runtime's context opens the traffic log

    @property
    def config(self) -> ModelConfig:
        return self.runner.config

    @property
    def model(self) -> DecoderModel:
        return self.runner.model

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | None = None,
        dtype: str | None = None,
        config: EngineConfig | None = None,
        **overrides,
    ) -> Engine:
        """Load an HF model directory. `device`/`dtype` and `overrides` (any `EngineConfig` field,
        e.g. attention="reference") take precedence over `config`; device defaults to "cpu"."""
        path = Path(path)
        config = config or EngineConfig()
        if device is not None:
            overrides["device"] = str(device)
        if dtype is not None:
            overrides["dtype"] = dtype
        try:
            config = dataclasses.replace(config, **overrides)
        except TypeError:
            known = ", ".join(f.name for f in dataclasses.fields(EngineConfig))
            raise ValueError(
                f"unknown engine option in {sorted(overrides)}; known: {known}"
            ) from None
        from boundgen.quant.policy import enable_fp8, parse_policy

        # a misspelt policy fails before any weight is read; the canonical name keys the compiled
        # artifacts, so "MLP" and "gate_up_proj+down_proj" share them
        fp8 = parse_policy(config.fp8).name
        log.info("loading %s on %s", path, config.device)  # start-up stamps: imports end here
        t0 = time.perf_counter()
        t_context = open_device(config.device)
        model = load_model(path, config.device, config.dtype, config.attention)
        t_weights = time.perf_counter() - t0 - t_context
        if fp8 != "none":
            enable_fp8(model, path, fp8, force=config.fp8_force, emulate=config.fp8_emulate)
        dev = next(model.parameters()).device
        runner = make_runner(
            model,
            dev,
            config.max_batch_tokens,
            config.share_prefix,
            backend=config.backend,
            options=CompileOptions(
                buckets=config.compile_buckets,
                cache_dir=config.compile_cache,
                quant=fp8,
                graph_max_tokens=config.graph_max_tokens,
                device_depth=config.batch_device_depth,
            ),
        )
        tokenizer = Tokenizer.from_dir(path)
        log.info(
            "loaded %s (%s) on %s in %s with %s attention "
            "(device context %.1f s, weights %.1f s, backend %.1f s)",
            path.name,
            model.config.architecture,
            dev,
            next(model.parameters()).dtype,
            model.backend.name,
            t_context,
            t_weights,
            time.perf_counter() - t0 - t_context - t_weights,
        )
        return cls(runner, tokenizer, config, path)

    def eos_token_ids(self) -> list[int]:
        ids = self.config.extra.get("eos_token_id")
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

    def workload_context(self) -> WorkloadContext:
        """What the workload pipelines are built from: this engine's runner, tokenizer and
        limits."""
        cfg = self.engine_config
        return WorkloadContext(
            self.runner,
            self.tokenizer,
            self.limits,
            beam_bounds=BeamBounds(cfg.max_beam_width, cfg.max_beam_steps),
            eos_token_ids=tuple(self.eos_token_ids()),
            token_budget=cfg.batch_token_budget,
            max_wait_ms=cfg.batch_max_wait_ms,
            traffic=self._traffic_log(),
            latency_target_ms=cfg.batch_latency_target_ms,
            device_depth=cfg.batch_device_depth,
            merge_policy=cfg.batch_merge,
            late_merge=cfg.batch_late_merge,
        )

    def _traffic_log(self) -> TrafficLog | None:
        """The one log of forward shapes (`EngineConfig.traffic_log`), opened on first use."""
        path = self.engine_config.traffic_log
        if path is None:
            return None
        with self._runtime_lock:
            if self._traffic is None:
                self._traffic = TrafficLog(path)
            return self._traffic

    def with_runner(self, runner: ModelRunner) -> Engine:
        """The same checkpoint served through another runner (e.g. another backend)."""
        return Engine(runner, self.tokenizer, self.engine_config, self.model_path)

    @property
    def runtime(self) -> EngineRuntime:
        """The runtime every call runs through (built on first use)."""
        if self._runtime is None:
            with self._runtime_lock:
                if self._runtime is None:
                    self._runtime = EngineRuntime(
                        self.workload_context(), cpu_workers=self.engine_config.cpu_workers
                    )
        return self._runtime

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None
        if self._traffic is not None:
            self._traffic.close()
            self._traffic = None

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
        """result[i][j]: the probability of label_token_ids[j] after query + items[i] (SGLang
        /v1/score): under the softmax over the full vocabulary, or with `apply_softmax` over the
        label ids only. Text is joined before it is tokenized (query + item, or item + query with
        `item_first`); token ids are concatenated. (Before issue 18 the default returned raw label
        logits and text was tokenized in parts.)"""
        request = ScoreRequest(query, items, label_token_ids, apply_softmax, item_first, truncate)
        return self.runtime.run("score", request, timeout_ms)

    def classify(
        self, texts, truncate: bool = False, timeout_ms: float | None = None
    ) -> list[list[float]]:
        """Class logits per text ([N, num_labels]) of a *ForSequenceClassification checkpoint."""
        return self.runtime.run("classify", ClassifyRequest(texts, truncate), timeout_ms)

    def embed(
        self,
        texts,
        pooling: str = "last",
        normalize: bool = False,
        head: MLPHead | str | Path | None = None,
        truncate: bool = False,
        timeout_ms: float | None = None,
    ) -> torch.Tensor:
        """[N, hidden] (or [N, head outputs]): last-token or mean hidden state per text."""
        request = EmbedRequest(texts, pooling, normalize, truncate)
        return self.runtime.run("embed", request, timeout_ms, head=head)

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
        """Beam search for many prompts in one packed prefill and one decode loop."""
        request = BeamRequest(prompts, beam_width, steps, top_k, trie, truncate)
        return self.runtime.run("beam", request, timeout_ms)

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
        """Top sequences (generated token ids, cumulative log-prob), best first."""
        if not isinstance(prompt, str) and not (
            isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt)
        ):
            raise ValueError("prompt must be a string or a non-empty list of token ids")
        return self.beam_search_batch(
            [prompt], beam_width, steps, top_k, trie, truncate, timeout_ms
        )[0]
