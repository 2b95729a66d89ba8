"""Train the built-in demo model: a small Qwen2 on the synthetic catalog, on the CPU, in minutes.

One model, two tasks: relevance ("query + item -> ' yes'/' no'" at the last token) and generative
retrieval ("query or history -> 3 semantic-ID tokens"), plus an index task (title -> semantic ID).
Writes a standard HF Qwen2 checkpoint (loads in `transformers`) plus the catalog, its trie and the
held-out eval sets. `train(TrainConfig(), out_dir)`, or `boundgen train-demo --out DIR`.
"""

from __future__ import annotations

import dataclasses
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
from boundgen.runner import ModelRunner
from boundgen.settings import option
from boundgen.workloads.trie import Trie

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
    """Right-padded ids [B, T] → hidden [B, T, H]. Each row is one causal segment of length T, so
    the padding (after a row's real tokens) never reaches a real token, and equal segments batch
    into one attention call."""
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
    """Right-padded ids [B, T], target rows/cols/tokens, next-token targets [B, T-1] (-100 on pad),
    auxiliary targets [A, 3] (row, position, token)."""
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


def catalog_trie(enc: Encoder) -> Trie:
    """Every catalog item's semantic-ID tokens, keyed by item id (as `catalog_trie.jsonl`)."""
    items = enc.catalog.items
    return Trie.from_sequences(
        [enc.sid_ids(it.item_id) for it in items], [it.item_id for it in items]
    )


SID_BEAM_WIDTH = 10  # the beam width and k of recall@k in the held-out retrieval evaluation


def beam_items(model: DecoderModel, prompts: list[list[int]], trie: Trie) -> list[list[int]]:
    """Item ids of the top beams per prompt, best first: the engine's trie-constrained beam
    search (`ModelRunner.beam_search`, the code behind `engine.beam_search(..., trie=...)`) on
    the training model."""
    runner = ModelRunner(model, model.embed_tokens.weight.device)
    tokens, scores = runner.beam_search(prompts, SID_BEAM_WIDTH, trie.depth, trie)
    # tokens: [B, W, depth]; scores: [B, W], dead beams (fewer items than W) at -inf
    return [trie.item_ids(tokens[b][torch.isfinite(scores[b])]) for b in range(tokens.shape[0])]


@torch.no_grad()
def evaluate(
    model: DecoderModel, enc: Encoder, test: dict, limit: int = 100, beams: bool = True
) -> dict:
    """Held-out relevance AUC (label logits of the scoring prompt) and, with `beams`, recall@10 of
    trie-constrained beam search for query and history prompts. `model` on the CPU (the batches
    are built there)."""
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
    trie = catalog_trie(enc)
    rec = {}
    for name, prompt_of in (
        ("retrieval", lambda q: enc.retrieval_prompt(q["query"])),
        ("history", lambda h: enc.history_prompt(h["history"])),
    ):
        cases = test[name][:limit]
        got = beam_items(model, [prompt_of(q) for q in cases], trie)
        vals = [recall_at_k(items, q["relevant"], SID_BEAM_WIDTH) for items, q in zip(got, cases)]
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


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a demo training run; the defaults are the recipe of the shipped model. Each
    field is also a `boundgen train-demo` flag (`boundgen.settings`)."""

    seed: int = option(0, "seed of the catalog, splits, tokenizer, initial weights and batches")
    steps: int = option(1600, "optimizer steps")
    lr: float = option(2e-3, "peak AdamW learning rate (linear warmup, then cosine decay)")
    # NOTE: 2 threads is the shipped recipe (8.6 min of training on an idle 2-core machine), and
    # the weights are bit-identical only at the same thread count. On a CPU shared with other
    # processes OpenMP spin-waiting made 2 threads 20x slower than 1; OMP_WAIT_POLICY=PASSIVE
    # avoids that.
    threads: int = option(
        2, "torch CPU threads (same count for the same weights; busy CPU: OMP_WAIT_POLICY=PASSIVE)"
    )
    device: str = option("cpu", "torch device (the shipped model is trained on cpu)")
    num_items: int = option(3000, "catalog size")
    bpe_vocab_size: int = option(1536, "BPE vocabulary trained on the catalog text (before IDs)")
    hidden_size: int = option(128, "model width (MLP width: 8/3 of it, rounded down to 32)")
    num_layers: int = option(4, "decoder layers")
    rel_batch: int = option(
        128, "relevance sequences per step (query-item pairs, or packed groups)"
    )
    retrieval_batch: int = option(16, "query -> ID examples per step")
    history_batch: int = option(8, "history -> ID examples per step")
    index_batch: int = option(12, "title -> ID examples per step")
    rel_weight: float = option(2.0, "weight of the relevance label loss")
    aux_weight: float = option(
        1.0, "weight of the per-attribute match flags in relevance training (0: off)"
    )
    lm_weight: float = option(0.0, "weight of an auxiliary next-token loss on every token (0: off)")
    pack_relevance: bool = option(
        False, "all candidates of a query in one relevance sequence instead of one pair each"
    )
    eval_every: int = option(200, "quick held-out relevance AUC every N steps (0: never)")
    eval_limit: int = option(100, "held-out examples per task evaluated at the end")
    log_every: int = option(50, "print the losses every N steps")
    max_minutes: float | None = option(
        None, "stop training after this many minutes (the result is then not the recipe's)"
    )

    def __post_init__(self) -> None:
        positive = (
            "steps threads num_items bpe_vocab_size hidden_size num_layers rel_batch "
            "retrieval_batch history_batch index_batch eval_limit log_every"
        )
        for name in positive.split():
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("lr", "rel_weight", "aux_weight", "lm_weight", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"max_minutes must be positive, got {self.max_minutes}")

    @property
    def batch_sizes(self) -> dict[str, int]:
        # NOTE: the order is the order in which each step samples the tasks (part of the recipe).
        return {
            "relevance": self.rel_batch,
            "retrieval": self.retrieval_batch,
            "history": self.history_batch,
            "index": self.index_batch,
        }


def train(config: TrainConfig, out_dir: Path) -> dict:
    """Build catalog + tokenizer, train, evaluate, write the checkpoint to `out_dir`; returns the
    run's record (also written to demo.json)."""
    c = config
    torch.set_num_threads(c.threads)
    torch.manual_seed(c.seed)
    rng = random.Random(c.seed)
    t0 = time.time()
    catalog = cat.make_catalog(c.seed, c.num_items)
    splits = cat.make_splits(catalog, c.seed)
    tok = train_tokenizer(cat.corpus_lines(catalog, splits), vocab_size=c.bpe_vocab_size)
    enc = Encoder(tok, catalog)
    vocab = (tok.get_vocab_size() + 63) // 64 * 64
    model_config = TinyConfig(
        vocab_size=vocab,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_layers,
        intermediate_size=c.hidden_size * 8 // 3 // 32 * 32,
    )
    model = build_model(model_config, tok.token_to_id(EOS)).to(c.device)
    data = build_examples(enc, splits, c.pack_relevance, c.seed)
    batch_sizes = c.batch_sizes
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"catalog {len(catalog.items)} items, vocab {vocab}, {n_params / 1e6:.2f}M params, "
        f"examples { {k: len(v) for k, v in data.items()} }, setup {time.time() - t0:.0f}s",
        flush=True,
    )

    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, c.steps // 20)

    def lr_at(step):
        if step < warmup:
            return c.lr * (step + 1) / warmup
        p = (step - warmup) / max(1, c.steps - warmup)
        return c.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p)))

    pad = tok.token_to_id(EOS)
    t_train, cpu_train = time.time(), time.process_time()
    done = 0
    for step in range(c.steps):
        if c.max_minutes is not None and time.time() - t_train > c.max_minutes * 60:
            print(f"stopping at step {step}: --max-minutes {c.max_minutes} reached", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        total = 0.0
        losses = {}
        for task, bs in batch_sizes.items():
            batch = rng.sample(data[task], bs)
            ids, rows, cols, tgt, nxt, aux = (x.to(c.device) for x in collate(batch, pad))
            hidden = hidden_states(model, ids)
            loss = F.cross_entropy(model.head(hidden[rows, cols]), tgt)
            losses[task] = loss.item()
            total = total + (c.rel_weight if task == "relevance" else 1.0) * loss
            if c.aux_weight > 0 and len(aux):
                aux_loss = F.cross_entropy(model.head(hidden[aux[:, 0], aux[:, 1]]), aux[:, 2])
                losses["aux"] = aux_loss.item()
                total = total + c.aux_weight * aux_loss
            if c.lm_weight > 0:
                lm = F.cross_entropy(model.head(hidden[:, :-1]).flatten(0, 1), nxt.flatten())
                total = total + c.lm_weight * lm
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = step + 1
        if c.eval_every and step and step % c.eval_every == 0:
            quick = evaluate(model.cpu(), enc, splits["test"], limit=20, beams=False)
            model.to(c.device)
            print(
                f"step {step:5d}  held-out relevance AUC (20 groups) {quick['auc']:.3f}", flush=True
            )
        if step % c.log_every == 0 or step == c.steps - 1:
            el = time.time() - t_train
            print(
                f"step {step:5d}  {el:5.0f}s  "
                + "  ".join(f"{k} {v:.3f}" for k, v in losses.items()),
                flush=True,
            )
    train_s, cpu_s = time.time() - t_train, time.process_time() - cpu_train
    model = model.cpu()
    metrics = evaluate(model, enc, splits["test"], c.eval_limit)
    print(f"trained {done} steps in {train_s:.0f}s; held-out {metrics}", flush=True)
    meta = {
        **dataclasses.asdict(c),
        "steps": done,
        "train_seconds": round(train_s, 1),
        "cpu_seconds": round(cpu_s, 1),
        "batch_sizes": batch_sizes,
        "params": n_params,
        "heldout_metrics_at_training": metrics,
    }
    save_checkpoint(model, model_config.to_hf(pad), tok, enc, catalog, splits, Path(out_dir), meta)
    print(f"wrote {out_dir}", flush=True)
    return meta
