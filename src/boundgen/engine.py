"""`Engine`: the Python API over a checkpoint (score, classify, embed, beam search).

Every call runs as a DAG through `boundgen.runtime` (the same pipelines the HTTP server uses), so
concurrent calls from several threads are batched together and carry optional deadlines
(`timeout_ms`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from boundgen.attention.backends import get_backend
from boundgen.config import DTYPES, EngineConfig, ModelConfig
from boundgen.models.decoder import DecoderModel
from boundgen.models.weights import load_weights
from boundgen.text.tokenizer import Tokenizer
from boundgen.workloads.embed import MLPHead
from boundgen.workloads.inputs import Limits

log = logging.getLogger("boundgen")


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device '{device}'; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device '{device}'; use 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available on this machine")
    return dev


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device, config: ModelConfig
) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")
        return dtype
    if dtype is None:
        # CPU matmuls are fastest and exact in float32; on GPUs keep the checkpoint's precision.
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(config.torch_dtype or "bfloat16", torch.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


class Engine:
    def __init__(
        self, model: DecoderModel, tokenizer: Tokenizer, config: EngineConfig, model_path: Path
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.engine_config = config
        self.model_path = model_path
        # The checkpoint's own name (HF `_name_or_path`) when it has one, else its directory's name.
        self.model_name = Path(model.config.extra.get("_name_or_path") or model_path.name).name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        from boundgen.compile import CompileOptions, make_runner

        self.runner = make_runner(
            model,
            self.device,
            config.max_batch_tokens,
            config.share_prefix,
            backend=config.backend,
            options=CompileOptions(
                buckets=config.compile_buckets, cache_dir=config.compile_cache, quant=config.fp8
            ),
        )
        self._runtime = self._runtime_runner = None
        mc = model.config
        self.limits = Limits(
            vocab_size=mc.vocab_size,
            max_seq_len=min(
                config.max_seq_len or mc.max_position_embeddings, mc.max_position_embeddings
            ),
            max_items=config.max_items,
        )

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | None = None,
        dtype: str | None = None,
        config: EngineConfig | None = None,
        **overrides,
    ) -> Engine:
        """Load an HF model directory. `device`/`dtype` and `overrides` (any `EngineConfig` field, e.g.
        attention="reference") take precedence over `config`; device defaults to "cpu"."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model path {path} does not exist or is not a directory")
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
        model_config = ModelConfig.from_dir(path)
        dev = resolve_device(config.device)
        torch_dtype = resolve_dtype(config.dtype, dev, model_config)
        backend = get_backend(config.attention, dev, torch_dtype)
        with torch.device("meta"):
            model = DecoderModel(model_config, backend)
        model = model.to_empty(device=dev).to(torch_dtype)
        model.rotary.reset()
        load_weights(model, path)
        if config.fp8 != "none":
            from boundgen.quant.policy import enable_fp8

            enable_fp8(model, path, config.fp8, force=config.fp8_force, emulate=config.fp8_emulate)
        model.eval().requires_grad_(False)
        tokenizer = Tokenizer.from_dir(path)
        log.info(
            "loaded %s (%s) on %s in %s with %s attention",
            path.name,
            model_config.architecture,
            dev,
            torch_dtype,
            backend.name,
        )
        return cls(model, tokenizer, config, path)

    def _need_task(self, task: str, what: str) -> None:
        if self.config.task != task:
            kind = "a *ForCausalLM" if task == "causal_lm" else "a *ForSequenceClassification"
            raise ValueError(
                f"{what} needs {kind} checkpoint; {self.model_name} is {self.config.architecture}"
            )

    @property
    def runtime(self):
        """The DAG runtime every public call runs through (built on first use, and again if `runner` was
        swapped: its pipelines bind the runner)."""
        if self._runtime is None or self._runtime_runner is not self.runner:
            from boundgen.runtime.pipelines import EngineRuntime

            self._runtime, self._runtime_runner = EngineRuntime(self), self.runner
        return self._runtime

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None

    def eos_token_ids(self) -> list[int]:
        ids = self.config.extra.get("eos_token_id")
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

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
        """result[i][j]: logit of label_token_ids[j] at the last token of query + items[i] (SGLang /v1/score)."""
        return self.runtime.score(
            query,
            items,
            label_token_ids,
            apply_softmax,
            item_first,
            truncate,
            timeout_ms=timeout_ms,
        )

    def classify(
        self, texts, truncate: bool = False, timeout_ms: float | None = None
    ) -> list[list[float]]:
        return self.runtime.classify(texts, truncate, timeout_ms=timeout_ms)

    def embed(
        self,
        texts,
        pooling: str = "last",
        normalize: bool = False,
        head: MLPHead | str | Path | None = None,
        truncate: bool = False,
        timeout_ms: float | None = None,
    ) -> torch.Tensor:
        return self.runtime.embed(texts, pooling, normalize, head, truncate, timeout_ms=timeout_ms)

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
        return self.runtime.beam_search_batch(
            prompts, beam_width, steps, top_k, trie, truncate, timeout_ms=timeout_ms
        )

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
        return self.runtime.beam_search(
            prompt, beam_width, steps, top_k, trie, truncate, timeout_ms
        )
