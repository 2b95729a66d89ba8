"""The W5 baseline: the same `/v1/score` (and `/v1/rerank`) HTTP API, served by HF transformers
eager (sdpa).

Everything except the model call is boundgen's own server and runtime (schemas, limits,
admission, batching, metrics, uvicorn), so a side-by-side run measures the engine, not the web
stack: the `Engine` runs an `HFRunner` instead of boundgen's runner. Per forward the runner does
what a user of transformers would write: left-pad the full query+item sequences into one batch,
one forward with an attention mask, take each sequence's last hidden state; the head multiplies
the label columns.

    python benchmarks/baseline_hf_server.py --model DIR --device cuda --dtype bfloat16 --port 8001
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from boundgen.compile.chunking import chunk
from boundgen.config import DTYPES, EngineConfig, ModelConfig
from boundgen.engine import Engine
from boundgen.runtime.memory import MemoryPools
from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig
from boundgen.settings import add_flags, from_args
from boundgen.text.packing import SequenceGroup
from boundgen.text.tokenizer import Tokenizer


class HFRunner:
    """`ModelRunner`'s interface over `AutoModelForCausalLM` (sdpa attention): rows and head
    only."""

    backend_name = "hf-eager"
    share_prefix = False

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cuda",
        dtype: str = "bfloat16",
        max_batch_tokens: int = 65536,
    ):
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.hf = (
            AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa"
            )
            .to(self.device)
            .eval()
        )
        self.config = ModelConfig.from_dir(self.model_dir)
        self.dtype = DTYPES[dtype]
        self.max_batch_tokens = max_batch_tokens
        self.pools = MemoryPools(self.device)
        self.pad_id = 0

    @torch.inference_mode()
    def rows(
        self, groups: list[SequenceGroup], pooling: str | list[str] = "last", wanted=None
    ) -> torch.Tensor:
        # `wanted` (which rows are still wanted) is not asked: the baseline runs every piece
        if "mean" in ([pooling] if isinstance(pooling, str) else pooling):
            raise ValueError("the HF baseline pools the last token only")
        seqs = [g.prefix + s for g in groups for s in g.suffixes]
        out = []
        for piece in chunk([SequenceGroup([], seqs)], self.max_batch_tokens):
            out.append(self._last_hidden([s for g in piece.groups for s in g.suffixes]))
        return torch.cat(out)

    def _last_hidden(self, seqs: list[list[int]]) -> torch.Tensor:
        n, length = len(seqs), max(len(s) for s in seqs)
        ids = torch.full((n, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, length), dtype=torch.long)
        for i, s in enumerate(seqs):  # left padding: every last token sits in the last column
            ids[i, length - len(s) :] = torch.tensor(s)
            mask[i, length - len(s) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.hf.model(input_ids=ids, attention_mask=mask, position_ids=positions)
        return out.last_hidden_state[:, -1, :]

    @torch.inference_mode()
    def head(self, rows: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        return self._logits(rows, columns).float()

    def label_logits(self, rows: torch.Tensor, columns) -> torch.Tensor:
        return self._logits(rows, columns)

    def _logits(self, rows: torch.Tensor, columns) -> torch.Tensor:
        w = self.hf.get_output_embeddings().weight
        if columns is not None:
            w = w.index_select(0, torch.as_tensor(columns, device=w.device))
        return F.linear(rows, w)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu()

    def beam_search(self, *args, **kwargs):
        raise ValueError("the HF baseline server implements /v1/score and /v1/rerank only")

    def stats(self) -> dict:
        return {"backend": self.backend_name}


def hf_engine(model_dir: str | Path, device: str = "cuda", dtype: str = "bfloat16") -> Engine:
    """An `Engine` whose runner is HF transformers eager, with boundgen's tokenizer and runtime."""
    runner = HFRunner(model_dir, device, dtype)
    return Engine(runner, Tokenizer.from_dir(model_dir), EngineConfig(device=device), model_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    add_flags(parser, ServerConfig)
    args = parser.parse_args(argv)
    # no warm-up: the HF runner has no beam search, and a baseline is timed as it comes
    config = from_args(ServerConfig, args, base=ServerConfig(port=8001, warmup="off")).validate()
    if not config.model:
        parser.error("--model is required")
    engine = hf_engine(config.model, args.device, args.dtype)
    engine.score([1, 2, 3], [[4, 5]] * 4, [6, 7])  # warm up kernels before the first request
    from boundgen.server.uvicorn import serve

    print(
        f"HF baseline: {engine.model_name} on {engine.device} at http://{config.host}:{config.port}",
        file=sys.stderr,
        flush=True,
    )
    serve(create_app(engine, config), config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
