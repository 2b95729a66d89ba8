"""What a handler reads: `HandlerState` — the config, the engine's facts (`EngineFacts`), the
tokenizer, the tries, the one `Infer` object, limits, metrics and the KServe statistics. Its two
kinds: `state.ServerState` in the process that holds the engine (it also runs the warm-up), and
`frontend.FrontendState` in an HTTP frontend process (`--frontends`), whose `infer` and metrics go
to the engine's process over `link.py`. No torch here: a frontend process imports the handlers and
this without the engine (`tests/test_server_frontends.py` checks its memory holds no libtorch)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from boundgen.server.config import ServerConfig
from boundgen.server.limits import Limits
from boundgen.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from boundgen.engine import Engine
    from boundgen.workloads.trie import Trie

log = logging.getLogger("boundgen.server")


@dataclass(frozen=True)
class EngineFacts:
    """What handlers know of the engine besides its tokenizer: plain values, so a frontend
    process gets them over the link without the engine."""

    model_name: str  # the served name (the config's `served_model_name`, else the model's)
    model_path: str
    dtype: str  # "bfloat16"
    vocab_size: int
    hidden_size: int
    task: str  # "causal_lm" | "seq_cls"
    num_labels: int
    id2label: tuple
    max_seq_len: int
    max_items: int
    max_beam_width: int
    max_beam_steps: int
    token_budget: int
    cpu_workers: int
    trie_depths: Mapping[str, int] = field(default_factory=dict)  # the loaded tries, by name

    @classmethod
    def of(cls, engine: Engine, config: ServerConfig, tries: Mapping[str, Trie]) -> EngineFacts:
        mc, ec = engine.config, engine.engine_config
        return cls(
            model_name=config.served_model_name or engine.model_name,
            model_path=str(engine.model_path),
            dtype=str(engine.dtype).removeprefix("torch."),
            vocab_size=mc.vocab_size,
            hidden_size=mc.hidden_size,
            task=mc.task,
            num_labels=mc.num_labels if mc.task == "seq_cls" else 0,
            id2label=tuple(mc.id2label),
            max_seq_len=engine.limits.max_seq_len,
            max_items=ec.max_items,
            max_beam_width=ec.max_beam_width,
            max_beam_steps=ec.max_beam_steps,
            token_budget=engine.runtime.context.token_budget,
            cpu_workers=engine.runtime.executor.cpu_workers,
            trie_depths={name: trie.depth for name, trie in tries.items()},
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class HandlerState:
    """Everything a handler reads (the module docstring). `infer` is `Infer` or a stand-in with
    its call and `check_load`; `metrics` a `Metrics` or a stand-in with `observe_request` and
    `items`; `kserve_stats` an `InferenceStats` or a stand-in with `record`."""

    def __init__(
        self,
        facts: EngineFacts,
        config: ServerConfig,
        tokenizer: Tokenizer,
        tries: Mapping[str, Any],
        infer: Any,
        metrics: Any,
        kserve_stats: Any,
    ) -> None:
        self.facts = facts
        self.config = config
        self.tokenizer = tokenizer
        # name → `Trie` (a frontend: `link.TrieRef`), what a beam request carries to the runtime
        self.tries = dict(tries)
        self.infer = infer
        self.metrics = metrics
        self.kserve_stats = kserve_stats
        self.max_items = facts.max_items
        self.max_beam_width = facts.max_beam_width
        self.max_beam_steps = facts.max_beam_steps
        self.model_name = facts.model_name
        self.vocab_size = facts.vocab_size
        self.hidden_size = facts.hidden_size
        self.can_classify = facts.task == "seq_cls"
        self.num_labels = facts.num_labels
        self.id2label = list(facts.id2label)
        self.max_positions = facts.max_seq_len
        self.limits = Limits(config, self.vocab_size, self.max_positions)
        self.api_key = config.resolved_api_key()
        self.rerank_label_ids = self._rerank_labels()
        self.input_type_prefixes = config.input_type_prefixes()
        self.started = time.time()

    # Readiness, read by /health and KServe's: `ready` False while the engine warms up, `unready`
    # saying why (the 503's message), `draining` from the shutdown signal on.
    ready: bool
    unready: str
    draining: bool

    async def metrics_text(self) -> tuple[bytes, str]:
        """/metrics' body and content type."""
        return self.metrics.render()

    async def model_stats(self) -> dict[str, Any]:
        """KServe's statistics of the one model (Triton's `model_stats` entry)."""
        return self.kserve_stats.as_triton(self.model_name)

    def _rerank_labels(self) -> list[int] | None:
        ids = []
        for label in self.config.rerank_label_tokens:
            toks = self.tokenizer.encode(label)
            if len(toks) != 1:
                log.warning(
                    "rerank label %r is %d tokens %s, not 1: /v1/rerank is disabled",
                    label,
                    len(toks),
                    toks,
                )
                return None
            ids.append(int(toks[0]))
        return ids

    def timeout_ms(self, requested: int | None) -> int:
        return min(requested or self.config.timeout_ms, self.config.max_timeout_ms)

    def label(self, index: int) -> str:
        return str(self.id2label[index]) if index < len(self.id2label) else f"LABEL_{index}"
