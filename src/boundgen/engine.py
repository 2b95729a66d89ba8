"""`Engine`: the Python API over a checkpoint (score, classify, embed, beam search)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from boundgen.attention.backends import get_backend
from boundgen.config import EngineConfig, ModelConfig
from boundgen.models.decoder import DecoderModel
from boundgen.models.weights import load_weights
from boundgen.text.tokenizer import Tokenizer
from boundgen.workloads.classify import finish_classify, prepare_texts
from boundgen.workloads.embed import MLPHead, finish_embed
from boundgen.workloads.inputs import Limits
from boundgen.workloads.runner import ModelRunner
from boundgen.workloads.beam import BeamBounds, BeamRequest, finish_beam, prepare_beam, run_beam
from boundgen.workloads.score import ScoreRequest, finish_score, prepare_score

log = logging.getLogger("boundgen")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, config: ModelConfig) -> torch.dtype:
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
    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, config: EngineConfig,
                 model_path: Path) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.engine_config = config
        self.model_path = model_path
        self.model_name = model_path.name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.runner = ModelRunner(model, self.device, config.max_batch_tokens, config.share_prefix)
        mc = model.config
        self.limits = Limits(
            vocab_size=mc.vocab_size,
            max_seq_len=min(config.max_seq_len or mc.max_position_embeddings, mc.max_position_embeddings),
            max_items=config.max_items,
        )

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | None = None, dtype: str | None = None,
                        config: EngineConfig | None = None, **overrides) -> "Engine":
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
            raise ValueError(f"unknown engine option in {sorted(overrides)}; known: {known}") from None
        model_config = ModelConfig.from_dir(path)
        dev = resolve_device(config.device)
        torch_dtype = resolve_dtype(config.dtype, dev, model_config)
        backend = get_backend(config.attention, dev)
        with torch.device("meta"):
            model = DecoderModel(model_config, backend)
        model = model.to_empty(device=dev).to(torch_dtype)
        model.rotary.reset()
        load_weights(model, path)
        model.eval().requires_grad_(False)
        tokenizer = Tokenizer.from_dir(path)
        log.info("loaded %s (%s) on %s in %s with %s attention", path.name, model_config.architecture,
                 dev, torch_dtype, backend.name)
        return cls(model, tokenizer, config, path)

    def _need_task(self, task: str, what: str) -> None:
        if self.config.task != task:
            kind = "a *ForCausalLM" if task == "causal_lm" else "a *ForSequenceClassification"
            raise ValueError(f"{what} needs {kind} checkpoint; {self.model_name} is {self.config.architecture}")

    def score(self, query, items, label_token_ids, apply_softmax: bool = False,
              item_first: bool = False, truncate: bool = False) -> list[list[float]]:
        self._need_task("causal_lm", "score")
        req = ScoreRequest(query, items, label_token_ids, apply_softmax, item_first, truncate)
        groups = prepare_score(req, self.tokenizer, self.limits)
        rows = self.runner.hidden_rows(groups)
        return finish_score(self.runner.head(rows, req.label_token_ids), req)

    def classify(self, texts, truncate: bool = False) -> list[list[float]]:
        self._need_task("seq_cls", "classify")
        groups = prepare_texts(texts, self.tokenizer, self.limits, truncate)
        return finish_classify(self.runner.head(self.runner.hidden_rows(groups)))

    def embed(self, texts, pooling: str = "last", normalize: bool = False,
              head: MLPHead | str | Path | None = None, truncate: bool = False) -> torch.Tensor:
        if pooling not in ("last", "mean"):
            raise ValueError(f"unknown pooling '{pooling}'; use 'last' or 'mean'")
        if head is not None and not isinstance(head, MLPHead):
            head = MLPHead.load(head)
        groups = prepare_texts(texts, self.tokenizer, self.limits, truncate)
        return finish_embed(self.runner.hidden_rows(groups, pooling), normalize, head)

    def eos_token_ids(self) -> list[int]:
        ids = self.config.extra.get("eos_token_id")
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

    def beam_search_batch(self, prompts, beam_width: int, steps: int, top_k: int | None = None,
                          trie=None, truncate: bool = False) -> list[list[tuple[list[int], float]]]:
        """Beam search for many prompts in one packed prefill and one decode loop."""
        self._need_task("causal_lm", "beam search")
        req = BeamRequest(prompts, beam_width, steps, top_k, trie, truncate)
        bounds = BeamBounds(self.engine_config.max_beam_width, self.engine_config.max_beam_steps)
        ids = prepare_beam(req, self.tokenizer, self.limits, bounds)
        tokens, scores = run_beam(self.runner, ids, beam_width, steps, trie, self.eos_token_ids())
        return finish_beam(tokens, scores, top_k or beam_width)

    def beam_search(self, prompt, beam_width: int, steps: int, top_k: int | None = None,
                    trie=None, truncate: bool = False) -> list[tuple[list[int], float]]:
        """Top sequences (generated token ids, cumulative log-prob), best first."""
        if not isinstance(prompt, str) and not (isinstance(prompt, (list, tuple)) and prompt
                                                and all(isinstance(t, int) for t in prompt)):
            raise ValueError("prompt must be a string or a non-empty list of token ids")
        return self.beam_search_batch([prompt], beam_width, steps, top_k, trie, truncate)[0]
