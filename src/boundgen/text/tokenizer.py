"""A thin wrapper over a HuggingFace `tokenizers` tokenizer.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


@dataclass(frozen=True)
class Encoded:
    """One text's tokens with where each came from: `offsets[i]` is token i's character span in the
    text ((0, 0) for a special token the tokenizer added), `special[i]` whether it is one."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    special: list[bool]


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, eos_token_id: int | None = None) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos_token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        tok = _HFTokenizer.from_file(str(file))
        eos = None
        cfg = path / "tokenizer_config.json"
        if cfg.is_file():
            name = json.loads(cfg.read_text()).get("eos_token")
            if isinstance(name, dict):
                name = name.get("content")
            eos = tok.token_to_id(name) if isinstance(name, str) else None
        return cls(tok, eos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Holds the GIL while it works (~0.6 s per MiB of text): short texts only on a thread
        that must stay responsive."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """The same ids as `encode` per text; releases the GIL while it works, so other threads
        (a server's event loop) run meanwhile."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def encode_with_offsets(
        self, texts: list[str], add_special_tokens: bool = False
    ) -> list[Encoded]:
        return [
            Encoded(e.ids, e.offsets, [bool(m) for m in e.special_tokens_mask])
            for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        ]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)
