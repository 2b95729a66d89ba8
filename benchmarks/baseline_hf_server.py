"""The W5 baseline: the same `/v1/score` (and `/v1/rerank`) HTTP API, served by HF transformers eager (sdpa).

Everything except the model call is boundgen's own server (schemas, limits, admission, metrics,
uvicorn), so a side-by-side run measures the engine, not the web stack. Per request the baseline
does what a user of transformers would write: left-pad query+item sequences into one batch, one
forward with an attention mask and `logits_to_keep=1`, pick the label columns. Requests run one at a
time on a worker thread.

    python benchmarks/baseline_hf_server.py --model DIR --device cuda --dtype bfloat16 --port 8001
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

from boundgen.cliargs import add_dataclass_args, from_args
from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig
from boundgen.text.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFScorer:
    """An engine stand-in with `score` only, over `AutoModelForCausalLM` (sdpa attention)."""

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
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa"
            )
            .to(self.device)
            .eval()
        )
        self.tokenizer = Tokenizer.from_dir(self.model_dir)  # same tokenization as boundgen
        hf = self.model.config
        self.config = types.SimpleNamespace(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            task="causal_lm",
            max_position_embeddings=hf.max_position_embeddings,
            num_labels=0,
            id2label=(),
        )
        self.model_name = self.model_dir.name
        self.pad_id = 0
        self.max_batch_tokens = max_batch_tokens

    @torch.inference_mode()
    def score(
        self, query, items, label_token_ids, apply_softmax: bool = False, item_first: bool = False
    ) -> list[list[float]]:
        if isinstance(query, str) or (items and isinstance(items[0], str)):
            raise ValueError("the HF baseline takes token ids (the server tokenizes text)")
        seqs = [
            list(item) + list(query) if item_first else list(query) + list(item) for item in items
        ]
        labels = torch.tensor(label_token_ids, device=self.device)
        out = []
        for chunk in _chunks(seqs, self.max_batch_tokens):
            out.append(self._forward(chunk)[:, labels].float())
        logits = torch.cat(out)
        if apply_softmax:
            logits = torch.softmax(logits, dim=-1)
        return logits.cpu().tolist()

    def _forward(self, seqs: list[list[int]]) -> torch.Tensor:
        n, length = len(seqs), max(len(s) for s in seqs)
        ids = torch.full((n, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, length), dtype=torch.long)
        for i, s in enumerate(seqs):  # left padding: every last token sits in the last column
            ids[i, length - len(s) :] = torch.tensor(s)
            mask[i, length - len(s) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1
        ).logits
        return logits[:, -1, :]

    def _unsupported(self, *args, **kwargs):
        raise ValueError("the HF baseline server implements /v1/score and /v1/rerank only")

    classify = embed = beam_search = _unsupported


def _chunks(seqs: list[list[int]], max_tokens: int):
    start = 0
    while start < len(seqs):
        end, longest = start, 0
        while end < len(seqs) and max(longest, len(seqs[end])) * (end - start + 1) <= max_tokens:
            longest = max(longest, len(seqs[end]))
            end += 1
        end = max(end, start + 1)
        yield seqs[start:end]
        start = end


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    add_dataclass_args(parser, ServerConfig)
    args = parser.parse_args(argv)
    config = from_args(ServerConfig, args, base=ServerConfig(port=8001, runtime=False)).validate()
    if not config.model:
        parser.error("--model is required")
    scorer = HFScorer(config.model, args.device, args.dtype)
    scorer.score([1, 2, 3], [[4, 5]] * 4, [6, 7])  # warm up kernels before the first request
    from boundgen.server.uvicorn import serve

    print(
        f"HF baseline: {scorer.model_name} on {scorer.device} at http://{config.host}:{config.port}",
        file=sys.stderr,
        flush=True,
    )
    serve(create_app(scorer, config), config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
