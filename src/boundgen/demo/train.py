"""Train the built-in demo model: a small Qwen2 on the synthetic catalog, on the CPU, in minutes.

One model, two tasks: relevance ("query + item -> ' yes'/' no'" at the last token) and generative
retrieval ("query or history -> 3 semantic-ID tokens"), plus an index task (title -> semantic ID).
Writes a standard HF Qwen2 checkpoint (loads in `transformers`) plus the catalog, its trie and the
held-out eval sets. `python -m boundgen.demo.train --out DIR` or `boundgen train-demo --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from boundgen.attention.metadata import AttnInputs
from boundgen.config import ModelConfig
from boundgen.demo import catalog as cat
from boundgen.models.decoder import DecoderModel
from boundgen.models.weights import hf_state_dict, load_weights

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf(self, eos_id: int) -> dict:
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "_name_or_path": "boundgen-demo",
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
            "torch_dtype": "float32",
            "use_cache": True,
        }


# ------------------------------------------------------------ the engine's own decoder, trained


def build_model(c: TinyConfig, eos_id: int) -> DecoderModel:
    """The engine's `DecoderModel` for this config (the same code that serves it), initialised for
    training: every projection and the (tied) embedding from N(0, 0.02), biases zero, norms one."""
    model = DecoderModel(ModelConfig.from_hf(c.to_hf(eos_id)))
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    return model


def hidden_states(model: DecoderModel, ids: torch.Tensor) -> torch.Tensor:
    """Right-padded ids [B, T] → hidden [B, T, H]. Each row is one causal segment of length T, so the
    padding (after a row's real tokens) never reaches a real token, and equal segments batch into
    one
    attention call."""
    b, t = ids.shape
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=ids.device)
    positions = torch.arange(t, device=ids.device).repeat(b)
    return model(ids.reshape(-1), positions, AttnInputs(cu, t)).view(b, t, -1)


def lm_logits(model: DecoderModel, ids: torch.Tensor) -> torch.Tensor:
    return model.head(hidden_states(model, ids))


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(lines: list[str], vocab_size: int):
    """Byte-level BPE on the catalog text; semantic-ID tokens added as whole tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    tok.add_tokens([AddedToken(s, normalized=False) for s in cat.sid_vocab()])
    return tok


def save_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": EOS,
                "bos_token": None,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 256,
            },
            indent=2,
        )
        + "\n"
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS, "pad_token": EOS}, indent=2) + "\n"
    )


# ---------------------------------------------------------------- examples


@dataclass
class Example:
    ids: list[int]
    targets: list[tuple[int, int]]  # (position whose logits predict, token id)
    aux: list[tuple[int, int]] = field(default_factory=list)  # relevance per-attribute flags


class Encoder:
    def __init__(self, tok, catalog: cat.Catalog):
        self.tok = tok
        self.catalog = catalog
        self.label_ids = [self.single_id(w) for w in cat.LABEL_WORDS]
        self._cache: dict[str, list[int]] = {}

    def single_id(self, text: str) -> int:
        ids = self.tok.encode(text).ids
        if len(ids) != 1:
            raise RuntimeError(f"{text!r} is not a single token: {ids}")
        return ids[0]

    def enc(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = self.tok.encode(text).ids
        return self._cache[text]

    def sid_ids(self, item_id: int) -> list[int]:
        return self.enc(self.catalog.items[item_id].sid_text())

    def relevance(self, query: str, item_id: int) -> list[int]:
        title = self.catalog.items[item_id].title
        return self.enc(cat.RELEVANCE_QUERY_TEMPLATE.format(query=query)) + self.enc(
            cat.RELEVANCE_ITEM_TEMPLATE.format(title=title)
        )

    def relevance_example(self, query: str, attrs: dict, item_id: int, label: int) -> Example:
        """The scoring prompt with its label at the last token, plus per-attribute auxiliary
        targets: at the last token of each attribute in the title, ' no' if the query names that
        attribute with another value, else ' yes'. Dense signal for the comparison the final label
        needs; the engine only ever reads the last position, so the prompt format is unchanged."""
        it = self.catalog.items[item_id]
        q = self.enc(cat.RELEVANCE_QUERY_TEMPLATE.format(query=query))
        item_text = cat.RELEVANCE_ITEM_TEMPLATE.format(title=it.title)
        encoding = self.tok.encode(item_text)
        ids = q + encoding.ids
        base = len("Item: ")
        ends, pos = {}, base
        parts = [
            ("brand", it.brand),
            (None, " " + it.model),
            ("product_type", " " + it.product_type),
            ("color", ", " + it.color),
            ("band", f", ${it.price}"),
            ("city", ", " + it.city),
        ]
        for key, text in parts:
            pos += len(text)
            if key:
                ends[key] = pos
        aux = []
        yes, no = self.label_ids
        for key, end in ends.items():
            tok_idx = next(i for i, (a, b) in enumerate(encoding.offsets) if a <= end - 1 < b)
            if key == "product_type" and key not in attrs:
                ok = it.category == attrs["category"]
            else:
                ok = key not in attrs or getattr(it, key) == attrs[key]
            aux.append((len(q) + tok_idx, yes if ok else no))
        return Example(ids, [(len(ids) - 1, self.label_ids[1 - label])], aux)

    def retrieval_prompt(self, query: str) -> list[int]:
        return self.enc(cat.RETRIEVAL_TEMPLATE.format(query=query))

    def history_prompt(self, history: list[int]) -> list[int]:
        return self.enc(
            cat.HISTORY_TEMPLATE.format(history=cat.history_text(self.catalog, history))
        )

    def index_prompt(self, item_id: int) -> list[int]:
        return self.enc(cat.INDEX_TEMPLATE.format(title=self.catalog.items[item_id].title))

    @staticmethod
    def generative(prompt: list[int], sid: list[int]) -> Example:
        n = len(prompt)
        return Example(prompt + sid[:-1], [(n - 1 + i, s) for i, s in enumerate(sid)])


def packed_relevance(enc: Encoder, group: dict, rng: random.Random) -> Example:
    """One query with all its candidates in one sequence, in random order:
    `Query: q\nItem: t1\nRelevant: yes\nItem: t2\nRelevant: no ...`, a label target after each item.
    The first item's label sees exactly the scoring prompt; the others add signal per token."""
    cands = list(group["candidates"])
    rng.shuffle(cands)
    ids = enc.enc(cat.RELEVANCE_QUERY_TEMPLATE.format(query=group["query"]))
    targets = []
    newline = enc.enc("\n")
    for i, c in enumerate(cands):
        if i:
            ids = ids + newline
        ids = ids + enc.enc(
            cat.RELEVANCE_ITEM_TEMPLATE.format(title=enc.catalog.items[c["item_id"]].title)
        )
        label = enc.label_ids[1 - c["label"]]
        targets.append((len(ids) - 1, label))
        ids = ids + [label]
    return Example(ids[:-1], targets)


def build_examples(
    enc: Encoder, splits: dict, pack_relevance: bool = True, seed: int = 0
) -> dict[str, list[Example]]:
    tr = splits["train"]
    if pack_relevance:
        rng = random.Random(seed + 3)
        rel = [packed_relevance(enc, g, rng) for g in tr["relevance"]]
    else:
        rel = [
            enc.relevance_example(g["query"], g["attrs"], c["item_id"], c["label"])
            for g in tr["relevance"]
            for c in g["candidates"]
        ]
    ret = [
        enc.generative(enc.retrieval_prompt(q["query"]), enc.sid_ids(q["target"]))
        for q in tr["retrieval"]
    ]
    hist = [
        enc.generative(enc.history_prompt(h["history"]), enc.sid_ids(h["target"]))
        for h in tr["history"]
    ]
    idx = [
        enc.generative(enc.index_prompt(it.item_id), enc.sid_ids(it.item_id))
        for it in enc.catalog.items
    ]
    return {"relevance": rel, "retrieval": ret, "history": hist, "index": idx}


def collate(batch: list[Example], pad_id: int):
    """Right-padded ids [B, T], target rows/cols/tokens, next-token targets [B, T-1] (-100 on pad)."""
    t = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), t), pad_id, dtype=torch.long)
    nxt = torch.full((len(batch), max(1, t - 1)), -100, dtype=torch.long)
    rows, cols, tgt, aux = [], [], [], []
    for i, e in enumerate(batch):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        nxt[i, : len(e.ids) - 1] = torch.tensor(e.ids[1:])
        for pos, tok in e.targets:
            rows.append(i)
            cols.append(pos)
            tgt.append(tok)
        aux += [(i, pos, tok) for pos, tok in e.aux]
    aux_t = torch.tensor(aux, dtype=torch.long).reshape(-1, 3)
    return ids, torch.tensor(rows), torch.tensor(cols), torch.tensor(tgt), nxt, aux_t


# ------------------------------------------------------------ evaluation with the training model


def auc(scores: list[float], labels: list[int]) -> float:
    """Probability that a random positive outranks a random negative (ties count half)."""
    pairs = sorted(zip(scores, labels))
    n_pos = sum(labels)
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    rank_sum, i = 0.0, 0
    while i < len(pairs):
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            j += 1
        avg_rank = (i + j + 1) / 2  # 1-based ranks i+1..j
        rank_sum += avg_rank * sum(lab for _, lab in pairs[i:j])
        i = j
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def recall_at_k(retrieved: list[int], relevant: list[int], k: int = 10) -> float:
    """|top-k ∩ relevant| / min(k, |relevant|)."""
    rel = set(relevant)
    return len(set(retrieved[:k]) & rel) / min(k, len(rel))


def build_trie(enc: Encoder) -> dict:
    trie: dict = {}
    for it in enc.catalog.items:
        node = trie
        for t in enc.sid_ids(it.item_id):
            node = node.setdefault(t, {})
    return trie


@torch.no_grad()
def model_beam(
    model: DecoderModel, prompt: list[int], trie: dict, width: int = 10
) -> list[list[int]]:
    """Trie-constrained beam search by full recompute (3 steps, tiny model): the reference the
    engine's `beam_search(..., trie=...)` should agree with."""
    beams: list[tuple[list[int], float, dict]] = [([], 0.0, trie)]
    for _ in range(3):
        ids = torch.tensor([prompt + b[0] for b in beams])
        logp = torch.log_softmax(lm_logits(model, ids)[:, -1].float(), -1)
        cand = []
        for (toks, lp, node), row in zip(beams, logp):
            for t, child in node.items():
                cand.append((toks + [t], lp + row[t].item(), child))
        cand.sort(key=lambda c: -c[1])
        beams = cand[:width]
    return [b[0] for b in beams]


@torch.no_grad()
def evaluate(
    model: DecoderModel, enc: Encoder, test: dict, limit: int = 100, beams: bool = True
) -> dict:
    model.eval()
    scores, labels = [], []
    for g in test["relevance"][:limit]:
        seqs = [enc.relevance(g["query"], c["item_id"]) for c in g["candidates"]]
        ids, *_ = collate([Example(s, []) for s in seqs], enc.label_ids[0])
        h = hidden_states(model, ids)[
            torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])
        ]
        lg = model.head(h)[:, enc.label_ids]
        scores += (lg[:, 0] - lg[:, 1]).tolist()
        labels += [c["label"] for c in g["candidates"]]
    if not beams:
        model.train()
        return {"auc": auc(scores, labels)}
    trie = build_trie(enc)
    sid_to_item = {tuple(enc.sid_ids(it.item_id)): it.item_id for it in enc.catalog.items}
    rec = {}
    for name, key, prompt_of in (
        ("retrieval", "retrieval", lambda q: enc.retrieval_prompt(q["query"])),
        ("history", "history", lambda h: enc.history_prompt(h["history"])),
    ):
        vals = []
        for q in test[key][:limit]:
            got = [sid_to_item[tuple(s)] for s in model_beam(model, prompt_of(q), trie)]
            vals.append(recall_at_k(got, q["relevant"]))
        rec[name] = sum(vals) / len(vals)
    model.train()
    return {
        "auc": auc(scores, labels),
        "recall@10_query": rec["retrieval"],
        "recall@10_history": rec["history"],
    }


# ---------------------------------------------------------------- checkpoint


def save_model(model: DecoderModel, hf_config: dict, tok, out: Path) -> None:
    """config.json + model.safetensors (HF Qwen2 names, tied: no lm_head.weight) + tokenizer."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    state = {k: v.contiguous().clone() for k, v in hf_state_dict(model).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(tok, out)


def load_model(path: Path) -> DecoderModel:
    """The training model (the engine's decoder, float32, CPU) from a checkpoint directory."""
    model = DecoderModel(ModelConfig.from_dir(path))
    load_weights(model, path)
    return model.eval()


def save_checkpoint(
    model: DecoderModel,
    hf_config: dict,
    tok,
    enc: Encoder,
    catalog: cat.Catalog,
    splits: dict,
    out: Path,
    meta: dict,
) -> None:
    save_model(model, hf_config, tok, out)
    with open(out / "catalog_trie.jsonl", "w") as f:
        f.writelines(
            json.dumps({"item_id": it.item_id, "tokens": enc.sid_ids(it.item_id)}) + "\n"
            for it in catalog.items
        )
    (out / "catalog.json").write_text(json.dumps(catalog.to_json()) + "\n")
    (out / "eval.json").write_text(
        json.dumps(
            {
                "relevance": splits["test"]["relevance"],
                "retrieval": splits["test"]["retrieval"],
                "history": splits["test"]["history"],
                "held_out_items": splits["held_out_items"],
            }
        )
        + "\n"
    )
    (out / "demo.json").write_text(
        json.dumps(
            {
                "templates": {
                    "relevance_query": cat.RELEVANCE_QUERY_TEMPLATE,
                    "relevance_item": cat.RELEVANCE_ITEM_TEMPLATE,
                    "retrieval": cat.RETRIEVAL_TEMPLATE,
                    "history": cat.HISTORY_TEMPLATE,
                    "index": cat.INDEX_TEMPLATE,
                },
                "label_words": list(cat.LABEL_WORDS),
                "label_token_ids": enc.label_ids,
                "sid_levels": 3,
                "trie": "catalog_trie.jsonl",
                **meta,
            },
            indent=2,
        )
        + "\n"
    )


# ---------------------------------------------------------------- training

BATCH = {"relevance": 16, "retrieval": 16, "history": 8, "index": 12}  # relevance: packed groups


def train(
    out: Path,
    *,
    seed: int = 0,
    steps: int = 1600,
    lr: float = 2e-3,
    threads: int = 2,
    num_items: int = 3000,
    max_minutes: float = 10.0,
    eval_limit: int = 100,
    log_every: int = 50,
    lm_weight: float = 0.0,
    device: str = "cpu",
    hidden_size: int = 128,
    num_layers: int = 4,
    pack_relevance: bool = False,
    rel_batch: int | None = 128,
    aux_weight: float = 1.0,
    eval_every: int = 0,
    rel_weight: float = 2.0,
) -> dict:
    """Build catalog + tokenizer, train, evaluate (own trie beam search), write the checkpoint.

    `lm_weight`: weight of an auxiliary next-token loss on every prompt token (dense signal that
    teaches the model to read the query before the sparse label/ID losses can)."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    t0 = time.time()
    catalog = cat.make_catalog(seed, num_items)
    splits = cat.make_splits(catalog, seed)
    tok = train_tokenizer(cat.corpus_lines(catalog, splits), vocab_size=1536)
    enc = Encoder(tok, catalog)
    vocab = (tok.get_vocab_size() + 63) // 64 * 64
    config = TinyConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        intermediate_size=hidden_size * 8 // 3 // 32 * 32,
    )
    model = build_model(config, tok.token_to_id(EOS)).to(device)
    data = build_examples(enc, splits, pack_relevance, seed)
    batch_sizes = dict(BATCH, relevance=rel_batch or (BATCH["relevance"] if pack_relevance else 32))
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"catalog {len(catalog.items)} items, vocab {vocab}, {n_params / 1e6:.2f}M params, "
        f"examples { {k: len(v) for k, v in data.items()} }, setup {time.time() - t0:.0f}s",
        flush=True,
    )

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 20)

    def lr_at(step):
        if step < warmup:
            return lr * (step + 1) / warmup
        p = (step - warmup) / max(1, steps - warmup)
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p)))

    pad = tok.token_to_id(EOS)
    t_train, cpu_train = time.time(), time.process_time()
    done = 0
    for step in range(steps):
        if time.time() - t_train > max_minutes * 60:
            print(f"stopping at step {step}: --max-minutes {max_minutes} reached", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        total = 0.0
        losses = {}
        for task, bs in batch_sizes.items():
            batch = rng.sample(data[task], bs)
            ids, rows, cols, tgt, nxt, aux = (x.to(device) for x in collate(batch, pad))
            hidden = hidden_states(model, ids)
            loss = F.cross_entropy(model.head(hidden[rows, cols]), tgt)
            losses[task] = loss.item()
            total = total + (rel_weight if task == "relevance" else 1.0) * loss
            if aux_weight > 0 and len(aux):
                aux_loss = F.cross_entropy(model.head(hidden[aux[:, 0], aux[:, 1]]), aux[:, 2])
                losses["aux"] = aux_loss.item()
                total = total + aux_weight * aux_loss
            if lm_weight > 0:
                lm = F.cross_entropy(model.head(hidden[:, :-1]).flatten(0, 1), nxt.flatten())
                total = total + lm_weight * lm
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = step + 1
        if eval_every and step and step % eval_every == 0:
            quick = evaluate(model.cpu(), enc, splits["test"], limit=20, beams=False)
            model.to(device)
            print(
                f"step {step:5d}  held-out relevance AUC (20 groups) {quick['auc']:.3f}", flush=True
            )
        if step % log_every == 0 or step == steps - 1:
            el = time.time() - t_train
            print(
                f"step {step:5d}  {el:5.0f}s  "
                + "  ".join(f"{k} {v:.3f}" for k, v in losses.items()),
                flush=True,
            )
    train_s, cpu_s = time.time() - t_train, time.process_time() - cpu_train
    model = model.cpu()
    metrics = evaluate(model, enc, splits["test"], eval_limit)
    print(f"trained {done} steps in {train_s:.0f}s; held-out {metrics}", flush=True)
    meta = {
        "seed": seed,
        "steps": done,
        "train_seconds": round(train_s, 1),
        "cpu_seconds": round(cpu_s, 1),
        "threads": threads,
        "device": device,
        "lr": lr,
        "lm_weight": lm_weight,
        "pack_relevance": pack_relevance,
        "aux_weight": aux_weight,
        "rel_weight": rel_weight,
        "batch_sizes": batch_sizes,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_items": num_items,
        "params": n_params,
        "heldout_metrics_at_training": metrics,
    }
    save_checkpoint(model, config.to_hf(pad), tok, enc, catalog, splits, Path(out), meta)
    print(f"wrote {out}", flush=True)
    return meta


def main(argv: list[str] | None = None) -> int:
    """`python -m boundgen.demo.train`: the same flags and behaviour as `boundgen train-demo`."""
    from boundgen.commands.train_demo import add_arguments, run

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
