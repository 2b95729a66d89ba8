"""Prefix trie of valid item IDs (semantic IDs) for constrained beam search (DESIGN §4).

Every item is a fixed-depth token sequence of length `depth` with an item id. The trie is stored as
per-depth CSR tables on one device (private: `_child_ptr`, `_child_token`):

- depth `d` has `n_d = nodes_per_depth[d]` nodes numbered `0..n_d-1`; depth 0 is the root (node 0),
  depth `depth` holds the leaves (one per item);
- `child_ptr[d]`: int64 `[n_d + 1]`; the children of node `i` at depth `d` are the depth-`d+1` nodes
  `child_ptr[d][i] .. child_ptr[d][i+1]-1`;
- `child_token[d]`: int32 `[n_{d+1}]`; the token leading to each depth-`d+1` node, sorted ascending
  within each parent's range.

So the child of node `i` reached by the `j`-th token of its range is node `child_ptr[d][i] + j`.
Leaf `j` is item index `leaf_item[j]` (host int64 array), whose id is `item_ids[leaf_item[j]]`.

Step functions (`children`, `next_node`) are pure tensor ops on the trie's device: no host sync, no
per-beam Python loop. `children` with a `TrieWorkspace` also allocates nothing, so the beam search's
step (`children`, then gathers on logits and child ids) can sit inside a CUDA-graph-captured decode
step. A node id of `-1` means "dead beam": it has no children and every transition from it is `-1`
(other negative ids are not supported).

Scores (`softmax`): by default ("vocab") a beam's step log-prob is normalised over the full
vocabulary (HF `generate` with `prefix_allowed_tokens_fn`), so every step needs the full LM head.
A trie made with `softmax="children"` (`with_softmax`) normalises over the beam's trie children
instead; then a step only needs the logits of its level's tokens (`level_tokens`), and the search
runs the LM head on those columns alone (`candidates` gives each candidate's column there).

NOTE: duplicate token sequences are an error by default (the result could not be mapped back to one
item id); `on_duplicate="first"` keeps the first item instead. Item ids need not be unique.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["NotAnItemError", "Trie", "TrieWorkspace"]

_INT32_MAX = np.iinfo(np.int32).max
_DENSE_LOOKUP_MAX_CHILDREN = 1024  # above this, next_node binary-searches instead of comparing all
SOFTMAX = ("vocab", "children")
# A depth's children as a padded table [3, n_d + 1, C] int32 (tokens, child ids, level columns)
# when its padding is bounded: one gather a step instead of ten CSR kernels. Entries (12 bytes
# each) <= 2 * children + 65536, or any table up to _TABLE_SMALL entries (the W4 100K-item trie's
# depth 2, 51K nodes of up to 10 children: 513K entries, 6 MB).
_TABLE_SLACK = (2, 65536)
_TABLE_SMALL = 1 << 20


class NotAnItemError(KeyError, ValueError):
    """A token sequence that is not an item of the trie (a KeyError that is also a ValueError)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Trie:
    """Prefix trie of fixed-depth item token sequences, as per-depth CSR tables on one device."""

    def __init__(
        self,
        child_ptr: list[torch.Tensor],
        child_token: list[torch.Tensor],
        leaf_item: np.ndarray,
        item_ids: Sequence[Any] | None,
        max_children: tuple[int, ...],
        max_token: int,
        softmax: str = "vocab",
    ) -> None:
        # Use `from_sequences` / `from_file`; this only wires already-validated tables together.
        # NOTE: stored with one extra entry each, so the step functions need no special cases:
        # ptr_ext = [0, *child_ptr]: at index node + 1, node -1 reads start = end = 0 (no children);
        # tok_ext = [*child_token, 0] gives invalid slots a sentinel index whose token is 0.
        zero = torch.zeros(1, dtype=torch.int64, device=child_ptr[0].device)
        self._ptr_ext = [torch.cat([zero, p.to(torch.int64)]) for p in child_ptr]
        self._tok_ext = [torch.cat([t.to(torch.int32), zero.to(torch.int32)]) for t in child_token]
        self._child_ptr = [p[1:] for p in self._ptr_ext]  # also: end of node i = _child_ptr[i + 1]
        self._child_token = [t[:-1] for t in self._tok_ext]
        # 0-dim device scalars for `torch.where(..., out=)` (its binding wants tensors there).
        self._minus_one = torch.full((), -1, dtype=torch.int64, device=zero.device)
        self._sentinel = [torch.full((), len(t) - 1, **_i64(zero.device)) for t in self._tok_ext]
        self._leaf_item = leaf_item
        self._item_ids = item_ids  # None: the item index is the id
        self._max_children = max_children
        self._max_token = max_token
        device = child_ptr[0].device
        self._arange = torch.arange(max(max_children), dtype=torch.int64, device=device)
        self.softmax = _check_softmax(softmax)
        # Per depth: the distinct tokens there (sorted), and per child node (+ the sentinel slot,
        # column 0) the column of its token among them: a step's LM head on its level alone.
        self._level_tokens, self._col_ext = [], []
        for t in self._child_token:
            level, col = torch.unique(t.to(torch.int64), sorted=True, return_inverse=True)
            self._level_tokens.append(level)
            self._col_ext.append(torch.cat([col.view(-1), zero]))
        self._tables = [
            _children_table(p, t, c, k)
            for p, t, c, k in zip(self._ptr_ext, self._tok_ext, self._col_ext, max_children)
        ]

    # ------------------------------------------------------------------ build

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Sequence[int]] | np.ndarray | torch.Tensor,
        item_ids: Sequence[Any] | np.ndarray | None = None,
        *,
        device: torch.device | str = "cpu",
        on_duplicate: str = "error",
        softmax: str = "vocab",
    ) -> Trie:
        """Build from `sequences` `[items, depth]` (non-negative ints); ids default to row index.

        `on_duplicate`: "error" (default) raises naming both items; "first" keeps the first one.
        `softmax`: "vocab" (default) or "children" (see the module docstring).
        """
        _check_softmax(softmax)
        if on_duplicate not in ("error", "first"):
            raise ValueError(f"on_duplicate must be 'error' or 'first', got {on_duplicate!r}")
        ids = _normalize_ids(item_ids)
        seqs = _as_token_array(sequences, ids)
        num_rows, depth = seqs.shape
        if ids is not None and len(ids) != num_rows:
            raise ValueError(f"got {len(ids)} item ids for {num_rows} token sequences")
        _check_token_range(seqs, ids)

        rows = _SortedRows(seqs)
        leaf_new = rows.new_prefix(depth)
        if not leaf_new.all():
            dup = np.flatnonzero(~leaf_new)
            if on_duplicate == "error":
                first, second = int(rows.order[dup[0] - 1]), int(rows.order[dup[0]])
                raise ValueError(
                    f"items {_id_of(ids, first)!r} and {_id_of(ids, second)!r} have the same "
                    f"tokens "
                    f"{seqs[first].tolist()} ({len(dup)} duplicate sequence(s) in total; "
                    "pass on_duplicate='first' to keep the first of each)"
                )
            rows.keep(leaf_new)
        del leaf_new

        num_items = len(rows.order)
        child_ptr: list[np.ndarray] = []
        child_token: list[np.ndarray] = []
        max_children: list[int] = []
        prev_first = np.zeros(1, dtype=np.int64)  # depth 0: the root starts at row 0
        for d in range(depth):
            if d + 1 == depth:
                first = np.arange(num_items, dtype=np.int64)
            else:
                first = np.flatnonzero(rows.new_prefix(d + 1))
            # Children of depth-d node i start at the depth-(d+1) node sharing i's first row.
            ptr = np.empty(len(prev_first) + 1, dtype=np.int64)
            ptr[:-1] = np.searchsorted(first, prev_first)
            ptr[-1] = len(first)
            child_ptr.append(ptr)
            child_token.append(rows.tokens(first, d))
            max_children.append(int(np.diff(ptr).max()))
            prev_first = first

        return cls(
            [torch.from_numpy(p).to(device) for p in child_ptr],
            [torch.from_numpy(t).to(device) for t in child_token],
            rows.order,
            ids,
            tuple(max_children),
            int(seqs.max()),
            softmax,
        )

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        *,
        device: torch.device | str = "cpu",
        on_duplicate: str = "error",
        softmax: str = "vocab",
    ) -> Trie:
        """Load `.jsonl` (`{"item_id": ..., "tokens": [...]}` per line) or `.npy` `[items, depth]`.

        A `.npy` file's ids are the row index, unless a sibling `<stem>.ids.json` list exists.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"trie file not found: {path}")
        if path.suffix == ".npy":
            try:
                seqs = np.load(path, allow_pickle=False)
            except ValueError as exc:
                raise ValueError(f"{path}: not a plain .npy integer array ({exc})") from None
            ids = None
            ids_path = path.with_suffix(".ids.json")
            if ids_path.is_file():
                ids = json.loads(ids_path.read_text())
                if not isinstance(ids, list):
                    raise ValueError(f"{ids_path}: expected a JSON list of item ids")
            try:
                return cls.from_sequences(
                    seqs, ids, device=device, on_duplicate=on_duplicate, softmax=softmax
                )
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
        if path.suffix in (".jsonl", ".json"):
            ids, seqs = _read_jsonl(path)
            try:
                return cls.from_sequences(
                    seqs, ids, device=device, on_duplicate=on_duplicate, softmax=softmax
                )
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
        raise ValueError(f"{path}: unknown trie file type {path.suffix!r} (use .jsonl or .npy)")

    def save(self, path: str | os.PathLike) -> None:
        """Write the items in their original order as `.jsonl` or `.npy` (+ `<stem>.ids.json`)."""
        path = Path(path)
        seqs = self.sequences()
        if path.suffix == ".npy":
            np.save(path, seqs)
            ids_path = path.with_suffix(".ids.json")
            if self._item_ids is not None:
                ids_path.write_text(json.dumps(list(self._item_ids)))
            elif ids_path.exists():
                ids_path.unlink()  # a stale ids file would relabel the rows on load
        elif path.suffix in (".jsonl", ".json"):
            rows = seqs.tolist()
            ids = range(len(rows)) if self._item_ids is None else self._item_ids
            with open(path, "w") as f:
                for item_id, tokens in zip(ids, rows):
                    f.write(json.dumps({"item_id": item_id, "tokens": tokens}) + "\n")
        else:
            raise ValueError(f"{path}: unknown trie file type {path.suffix!r} (use .jsonl or .npy)")

    def sequences(self) -> np.ndarray:
        """All items' token sequences, int64 `[num_items, depth]`, in the original item order."""
        leaves = np.arange(self.num_items, dtype=np.int64)
        out = np.empty((self.num_items, self.depth), dtype=np.int64)
        node = leaves
        for d in range(self.depth - 1, -1, -1):
            ptr = self._child_ptr[d].cpu().numpy()
            out[:, d] = self._child_token[d].cpu().numpy()[node]
            node = np.searchsorted(ptr, node, side="right") - 1  # parent at depth d
        result = np.empty_like(out)
        result[self._leaf_item] = out
        return result

    # ------------------------------------------------------------- properties

    @property
    def depth(self) -> int:
        return len(self._child_ptr)

    @property
    def num_items(self) -> int:
        return len(self._leaf_item)

    def __len__(self) -> int:
        return self.num_items

    @property
    def device(self) -> torch.device:
        return self._child_ptr[0].device

    @property
    def nodes_per_depth(self) -> tuple[int, ...]:
        """`(1, n_1, ..., n_depth)`; `n_depth == num_items`."""
        return tuple(len(p) - 1 for p in self._child_ptr) + (self.num_items,)

    @property
    def max_children(self) -> tuple[int, ...]:
        """Largest child count of a node at each depth `0..depth-1` (the `C` of `children`)."""
        return self._max_children

    @property
    def nbytes(self) -> int:
        """Bytes of the device tables plus the host leaf→item map (not counting Python item ids)."""
        tables = sum(
            t.numel() * t.element_size()
            for t in self._ptr_ext
            + self._tok_ext
            + self._level_tokens
            + self._col_ext
            + [t for t in self._tables if t is not None]
        )
        return tables + self._arange.numel() * 8 + self._leaf_item.nbytes

    def __repr__(self) -> str:
        return (
            f"Trie(items={self.num_items}, depth={self.depth}, nodes={self.nodes_per_depth}, "
            f"max_children={self.max_children}, softmax={self.softmax!r}, device={self.device}, "
            f"nbytes={self.nbytes})"
        )

    def to(self, device: torch.device | str) -> Trie:
        """This trie with its tables on `device` (self when already there)."""
        device = torch.device(device)
        if _same_device(device, self.device):
            return self
        return Trie(
            [p.to(device) for p in self._child_ptr],
            [t.to(device) for t in self._child_token],
            self._leaf_item,
            self._item_ids,
            self._max_children,
            self._max_token,
            self.softmax,
        )

    def with_softmax(self, softmax: str) -> Trie:
        """This trie (self when unchanged) with its scores normalised over `softmax`: "vocab" or
        "children" (a new object on the same tables: searches key their graphs by the trie)."""
        if _check_softmax(softmax) == self.softmax:
            return self
        out = copy.copy(self)
        out.softmax = softmax
        return out

    @property
    def level_sizes(self) -> tuple[int, ...]:
        """Number of distinct tokens at each depth `0..depth-1` (the columns of `level_tokens`)."""
        return tuple(len(t) for t in self._level_tokens)

    def level_tokens(self, depth: int) -> torch.Tensor:
        """The distinct tokens at `depth`, sorted, int64 `[level_sizes[depth]]` (device)."""
        self._check_depth(depth)
        return self._level_tokens[depth]

    def level_csr(self, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth `depth`'s tables for a step in one kernel (`trie_select`): child_ptr int64
        `[n_d + 1]` (node i's children are the depth-`depth + 1` nodes child_ptr[i] ..
        child_ptr[i + 1] - 1) and child_token int32 `[n_{d+1}]` (each child's token)."""
        self._check_depth(depth)
        return self._child_ptr[depth], self._child_token[depth]

    def level_columns(self, depth: int) -> torch.Tensor:
        """Each depth-`depth + 1` node's token as a column of `level_tokens(depth)`, int64
        `[n_{d+1} + 1]` (the last: a sentinel, column 0): a step over the level's logits alone
        in one kernel (`trie_select`)."""
        self._check_depth(depth)
        return self._col_ext[depth]

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError naming a token (and an item holding it) if any token >= vocab_size."""
        if self._max_token < vocab_size:
            return
        for d, tokens in enumerate(self._child_token):
            bad = torch.nonzero(tokens >= vocab_size)
            if len(bad):
                node = int(bad[0])
                token = int(tokens[node])
                for dd in range(d + 1, self.depth):  # any leaf below the offending node
                    node = int(self._child_ptr[dd][node])
                item = self._item_id(int(self._leaf_item[node]))
                raise ValueError(
                    f"trie token {token} (position {d}, e.g. item {item!r}) is outside the "
                    f"vocabulary of size {vocab_size}; max trie token is {self._max_token}"
                )

    # ------------------------------------------------------------ step functions

    def workspace(self, num_rows: int) -> TrieWorkspace:
        """Buffers for `children(..., ws=)` on `num_rows` beams, at every depth."""
        return TrieWorkspace(num_rows, max(self._max_children), self.device)

    def children(
        self, depth: int, node: torch.Tensor, *, ws: TrieWorkspace | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Allowed next tokens of each node at `depth`.

        node: LongTensor `[N]` of node ids at `depth` (-1: dead beam, no children).
        Returns `(tokens, child, valid)`, each `[N, C]` with `C = max_children[depth]`:
        tokens int64 (0 where invalid, so always a safe gather index), child int64 node ids at
        `depth + 1` (-1 where invalid), valid bool. Children are in ascending token order.
        With `ws`, the results are views into its buffers, overwritten by its next use.
        """
        return self._children(depth, node, ws)[:3]

    def candidates(
        self, depth: int, node: torch.Tensor, *, ws: TrieWorkspace | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`children` plus each candidate's column in `level_tokens(depth)`: `(tokens, child,
        valid, cols)`, cols int64 `[N, C]` (0 where invalid), so that
        `level_tokens(depth)[cols] == tokens`."""
        return self._children(depth, node, ws, columns=True)

    def _children(self, depth: int, node: torch.Tensor, ws, columns: bool = False) -> tuple:
        self._check_depth(depth)
        node = self._check_node(node)
        n, c = node.shape[0], self._max_children[depth]
        ws = self._workspace_for(ws, n, c)
        ptr = self._ptr_ext[depth]
        v = ws.views(c)

        torch.add(node, 1, out=ws.node)  # index into ptr_ext; a dead node reads [0, 0)
        table = self._tables[depth]
        if table is not None:  # row node + 1 (row 0: the dead node, no children)
            torch.index_select(table, 1, ws.node, out=v.table32)
            v.table.copy_(v.table32)
            torch.ge(v.table_child, 0, out=v.valid)
            if not columns:
                return v.table_tokens, v.table_child, v.valid
            return v.table_tokens, v.table_child, v.valid, v.table_cols
        torch.index_select(ptr, 0, ws.node, out=ws.start)
        torch.index_select(self._child_ptr[depth], 0, ws.node, out=ws.end)
        torch.add(v.start_col, self._arange[:c], out=v.slot)  # candidate child ids [N, C]
        torch.lt(v.slot, v.end_col, out=v.valid)
        torch.where(v.valid, v.slot, self._minus_one, out=v.child)
        torch.where(v.valid, v.slot, self._sentinel[depth], out=v.slot)
        torch.index_select(self._tok_ext[depth], 0, v.slot_flat, out=v.tok32_flat)
        v.tokens.copy_(v.tok32)
        if not columns:
            return v.tokens, v.child, v.valid
        torch.index_select(self._col_ext[depth], 0, v.slot_flat, out=v.cols_flat)
        return v.tokens, v.child, v.valid, v.cols

    def next_node(self, depth: int, node: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Child id (at `depth + 1`) of each `node[N]` (at `depth`) via `token[N]`; -1 if none.

        Dead nodes (-1) and tokens that are not children give -1. Returns a new int64 `[N]`.
        """
        self._check_depth(depth)
        node = self._check_node(node)
        if token.shape != node.shape:
            raise ValueError(f"token shape {tuple(token.shape)} != node shape {tuple(node.shape)}")
        if not _same_device(token.device, self.device):
            raise ValueError(f"token is on {token.device}, trie on {self.device}")
        if self._max_children[depth] > _DENSE_LOOKUP_MAX_CHILDREN:
            return self._next_node_bsearch(depth, node, token.long())
        tokens, child, _ = self.children(depth, node)  # [N, C] each
        # Invalid slots have child -1, so a match there (token 0 vs padding) still yields -1; child
        # ids are >= 0 and tokens are unique within a node, so the row max is the match or -1.
        hit = tokens == token.unsqueeze(1)
        return torch.where(hit, child, self._minus_one).amax(1)

    def _next_node_bsearch(self, depth: int, node: torch.Tensor, token: torch.Tensor):
        ptr, toks = self._ptr_ext[depth][1:], self._child_token[depth]
        alive = node >= 0
        nc = node.clamp(min=0)
        lo, hi = ptr[nc], ptr[nc + 1]  # search [lo, hi) for the first child token >= token
        hi = torch.where(alive, hi, lo)
        end = hi.clone()
        last = toks.shape[0] - 1
        for _ in range(max(1, int(self._max_children[depth]).bit_length())):
            mid = (lo + hi) // 2
            go_right = (toks[mid.clamp(max=last)] < token) & (mid < hi)
            lo = torch.where(go_right, mid + 1, lo)
            hi = torch.where(go_right, hi, mid)
        found = (lo < end) & (toks[lo.clamp(max=last)] == token)
        return torch.where(found, lo, -1)

    # ------------------------------------------------------------ item lookup

    def leaf_nodes(self, tokens: torch.Tensor | np.ndarray | Sequence[Sequence[int]]):
        """Leaf node id per row of `tokens` `[K, depth]` (-1 where the row is not an item)."""
        if isinstance(tokens, torch.Tensor):
            seqs = tokens.to(device=self.device, dtype=torch.int64)
        else:
            seqs = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).to(self.device)
        if seqs.dim() != 2 or seqs.shape[1] != self.depth:
            raise ValueError(f"expected token sequences [K, {self.depth}], got {tuple(seqs.shape)}")
        node = torch.zeros(seqs.shape[0], dtype=torch.int64, device=self.device)
        for d in range(self.depth):
            node = self.next_node(d, node, seqs[:, d].contiguous())
        return node

    def item_ids(self, tokens: Sequence[int] | Sequence[Sequence[int]] | np.ndarray | torch.Tensor):
        """Item id of one sequence (list[int]) or the list of ids of many sequences `[K, depth]`.

        Raises NotAnItemError (a KeyError and ValueError) naming the first sequence that is no item.
        """
        arr = _lookup_array(tokens)
        single = arr.ndim == 1
        seqs = arr[None, :] if single else arr
        if seqs.ndim != 2 or seqs.shape[1] != self.depth:
            raise NotAnItemError(
                f"item sequences have {self.depth} tokens; got shape {tuple(arr.shape)}"
            )
        if seqs.shape[0] == 0:
            return []
        leaves = self.leaf_nodes(seqs).cpu().numpy()
        missing = np.flatnonzero(leaves < 0)
        if len(missing):
            raise NotAnItemError(
                f"tokens {seqs[missing[0]].tolist()} are not an item of the trie"
                + (f" ({len(missing)} of {len(seqs)} are not)" if len(missing) > 1 else "")
            )
        ids = [self._item_id(int(self._leaf_item[j])) for j in leaves]
        return ids[0] if single else ids

    def contains(self, tokens: Sequence[int] | np.ndarray | torch.Tensor) -> bool:
        """Whether one token sequence is an item."""
        arr = _lookup_array(tokens)
        if arr.ndim != 1 or arr.shape[0] != self.depth:
            return False
        return bool(self.leaf_nodes(arr[None, :])[0] >= 0)

    # ------------------------------------------------------------ helpers

    def _item_id(self, index: int) -> Any:
        return index if self._item_ids is None else self._item_ids[index]

    def _check_depth(self, depth: int) -> None:
        if not 0 <= depth < self.depth:
            raise ValueError(f"depth must be in [0, {self.depth}), got {depth}")

    def _check_node(self, node: torch.Tensor) -> torch.Tensor:
        if node.dim() != 1:
            raise ValueError(f"node must be a 1-D tensor of node ids, got {tuple(node.shape)}")
        if not _same_device(node.device, self.device):
            raise ValueError(f"node is on {node.device}, trie on {self.device}")
        return node if node.dtype == torch.int64 else node.long()

    def _workspace_for(self, ws: TrieWorkspace | None, n: int, c: int) -> TrieWorkspace:
        if ws is None:
            return TrieWorkspace(n, c, self.device)
        if ws.num_rows != n or ws.max_children < c or not _same_device(ws.device, self.device):
            raise ValueError(
                f"workspace is for {ws.num_rows} rows x {ws.max_children} children on {ws.device}; "
                f"need {n} x {c} on {self.device}"
            )
        return ws


class TrieWorkspace:
    """Buffers for `Trie.children` of one trie at a fixed number of beams (one per bucket).

    Not thread-safe: one workspace per concurrent decode loop. Results returned from calls that take
    it are views of these buffers and are overwritten by the next call.
    """

    def __init__(self, num_rows: int, max_children: int, device) -> None:
        self.num_rows, self.max_children = num_rows, max_children
        self.device = torch.device(device)
        n, size = num_rows, num_rows * max_children
        i64 = dict(dtype=torch.int64, device=self.device)
        self.node = torch.empty(n, **i64)
        self.start = torch.empty(n, **i64)
        self.end = torch.empty(n, **i64)
        self._flat = {
            "tokens": torch.empty(size, **i64),
            "child": torch.empty(size, **i64),
            "cols": torch.empty(size, **i64),
            "slot": torch.empty(size, **i64),
            "tok32": torch.empty(size, dtype=torch.int32, device=self.device),
            "valid": torch.empty(size, dtype=torch.bool, device=self.device),
            "table": torch.empty(3 * size, **i64),
            "table32": torch.empty(3 * size, dtype=torch.int32, device=self.device),
        }
        self._views: dict[int, _Views] = {}

    def views(self, c: int) -> _Views:
        """Contiguous `[N, c]` views of the flat buffers (cached per `c`)."""
        v = self._views.get(c)
        if v is None:
            v = self._views[c] = _Views(self, c)
        return v


class _Views:
    def __init__(self, ws: TrieWorkspace, c: int) -> None:
        n = ws.num_rows
        for name, flat in ws._flat.items():
            if name.startswith("table"):
                setattr(self, name, flat[: 3 * n * c].view(3, n, c))
            else:
                setattr(self, name, flat[: n * c].view(n, c))
        self.table_tokens, self.table_child, self.table_cols = self.table.unbind(0)
        self.slot_flat = self.slot.view(-1)
        self.tok32_flat = self.tok32.view(-1)
        self.cols_flat = self.cols.view(-1)
        self.start_col = ws.start.unsqueeze(1)
        self.end_col = ws.end.unsqueeze(1)


# ---------------------------------------------------------------- build helpers


def _children_table(ptr_ext, tok_ext, col_ext, c: int) -> torch.Tensor | None:
    """int32 [3, n + 1, c]: row r = node r - 1's children (tokens, child ids, level columns),
    padded with (0, -1, 0); row 0 is the dead node. None when the padding would be too large."""
    rows, children = len(ptr_ext) - 1, len(tok_ext) - 1
    entries = rows * c
    if entries > _TABLE_SMALL and entries > _TABLE_SLACK[0] * children + _TABLE_SLACK[1]:
        return None
    slot = ptr_ext[:-1].unsqueeze(1) + torch.arange(c, device=ptr_ext.device)
    valid = slot < ptr_ext[1:].unsqueeze(1)
    safe = torch.where(valid, slot, children)  # the sentinel slot: token 0, column 0
    child = torch.where(valid, slot, -1)
    return torch.stack([tok_ext[safe].long(), child, col_ext[safe]]).to(torch.int32)


def _check_softmax(softmax: str) -> str:
    if softmax not in SOFTMAX:
        raise ValueError(f"softmax must be one of {SOFTMAX}, got {softmax!r}")
    return softmax


def _i64(device) -> dict:
    return {"dtype": torch.int64, "device": device}


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    ia = a.index if a.index is not None else torch.cuda.current_device()
    ib = b.index if b.index is not None else torch.cuda.current_device()
    return ia == ib


def _normalize_ids(item_ids) -> list | None:
    if item_ids is None:
        return None
    if isinstance(item_ids, (np.ndarray, torch.Tensor)):
        return np.asarray(item_ids).tolist()  # plain Python ints/strs (JSON-serializable)
    return list(item_ids)


def _id_of(ids: list | None, index: int) -> Any:
    return index if ids is None else ids[index]


def _as_token_array(sequences, ids: list | None) -> np.ndarray:
    """`sequences` as a contiguous int64 `[items, depth]` array, or a ValueError naming the item."""
    if isinstance(sequences, torch.Tensor):
        sequences = sequences.detach().cpu().numpy()
    try:
        arr = np.asarray(sequences)
    except ValueError:  # ragged nested lists
        _raise_ragged(sequences, ids)
    if arr.dtype == object:
        _raise_ragged(sequences, ids)
    if arr.ndim >= 1 and arr.shape[0] == 0:
        raise ValueError("empty trie: no items")
    if arr.ndim != 2:
        raise ValueError(f"token sequences must be a 2-D [items, depth] array, got {arr.shape}")
    if arr.shape[1] == 0:
        raise ValueError("items must have at least one token (depth 0)")
    if arr.dtype.kind == "f":
        rows = np.flatnonzero((arr != np.round(arr)).any(axis=1))
        row = int(rows[0]) if len(rows) else 0
        raise ValueError(
            f"tokens must be integers, got {arr.dtype} "
            f"(item {_id_of(ids, row)!r}: {arr[row].tolist()})"
        )
    if arr.dtype.kind not in "iu":
        _raise_ragged(sequences, ids)
    return np.ascontiguousarray(arr, dtype=np.int64)


def _raise_ragged(sequences, ids: list | None):
    seqs = list(sequences)
    if not seqs:
        raise ValueError("empty trie: no items")
    lengths = []
    for i, s in enumerate(seqs):
        try:
            lengths.append(len(s))
        except TypeError:
            raise ValueError(
                f"item {_id_of(ids, i)!r}: tokens must be a list of ints, got {s!r}"
            ) from None
    depth = lengths[0]
    for i, n in enumerate(lengths):
        if n != depth:
            raise ValueError(
                f"ragged depths: item {_id_of(ids, i)!r} has {n} tokens, but item "
                f"{_id_of(ids, 0)!r} has {depth}; every item needs the same number of tokens"
            )
    for i, s in enumerate(seqs):  # same lengths: a non-integer entry made numpy give up
        for t in s:
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool):
                raise ValueError(f"tokens must be integers; item {_id_of(ids, i)!r} has {t!r}")
    raise ValueError("token sequences must be a 2-D [items, depth] integer array")


def _check_token_range(seqs: np.ndarray, ids: list | None) -> None:
    if seqs.min() < 0:
        row = int(np.flatnonzero((seqs < 0).any(axis=1))[0])
        raise ValueError(f"negative token in item {_id_of(ids, row)!r}: {seqs[row].tolist()}")
    if seqs.max() > _INT32_MAX:
        row = int(np.flatnonzero((seqs > _INT32_MAX).any(axis=1))[0])
        raise ValueError(f"token above int32 in item {_id_of(ids, row)!r}: {seqs[row].tolist()}")


class _SortedRows:
    """Rows of `seqs` in stable lexicographic order (ties keep input order).

    When the tokens fit, each row is packed into one int64 key (`bits` per token), and the sort,
    prefix comparisons and token reads all work on that one array; with room for the row index too,
    a plain value sort of `key << index_bits | row` replaces the slower argsort. Else `np.lexsort`.
    """

    def __init__(self, seqs: np.ndarray) -> None:
        num_rows, self.depth = seqs.shape
        self.bits = max(1, int(seqs.max()).bit_length())
        self.keys: np.ndarray | None = None
        self.seqs: np.ndarray | None = None
        if self.bits * self.depth > 63:
            self.order = np.lexsort(seqs.T[::-1])  # lexsort is stable
            self.seqs = seqs[self.order]
            return
        key = np.zeros(num_rows, dtype=np.int64)
        for d in range(self.depth):
            key <<= self.bits
            key |= seqs[:, d]
        index_bits = max(1, (num_rows - 1).bit_length())
        if self.bits * self.depth + index_bits <= 63:
            key <<= index_bits
            key |= np.arange(num_rows, dtype=np.int64)
            key.sort()
            self.order = key & ((1 << index_bits) - 1)
            key >>= index_bits
            self.keys = key
        else:
            self.order = np.argsort(key, kind="stable")
            self.keys = key[self.order]

    def keep(self, mask: np.ndarray) -> None:
        self.order = self.order[mask]
        if self.keys is not None:
            self.keys = self.keys[mask]
        else:
            self.seqs = self.seqs[mask]

    def new_prefix(self, d: int) -> np.ndarray:
        """Bool `[rows]`: row r's length-d prefix differs from row r-1's (row 0 always True)."""
        new = np.empty(len(self.order), dtype=bool)
        new[0] = True
        if self.keys is not None:
            p = self.keys >> ((self.depth - d) * self.bits) if d < self.depth else self.keys
            np.not_equal(p[1:], p[:-1], out=new[1:])
        else:
            new[1:] = (self.seqs[1:, :d] != self.seqs[:-1, :d]).any(axis=1)
        return new

    def tokens(self, rows: np.ndarray, d: int) -> np.ndarray:
        """int32 token at position d of the given sorted rows."""
        if self.keys is None:
            return np.ascontiguousarray(self.seqs[rows, d], dtype=np.int32)
        shift = (self.depth - 1 - d) * self.bits
        picked = self.keys if len(rows) == len(self.keys) else self.keys[rows]
        return ((picked >> shift) & ((1 << self.bits) - 1)).astype(np.int32)


def _lookup_array(tokens) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    try:
        arr = np.asarray(tokens)
    except ValueError:
        raise NotAnItemError(f"token sequences must all have the same length: {tokens!r}") from None
    if arr.size and arr.dtype.kind not in "iu":
        raise NotAnItemError(f"tokens must be integers, got {tokens!r}")
    return arr.astype(np.int64, copy=False)


def _read_jsonl(path: Path) -> tuple[list, list]:
    """(item ids, token lists) of a JSONL trie file; ValueError with `path:line` on bad input."""
    with open(path) as f:
        lines = f.read().splitlines()
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise ValueError(f"{path}: empty trie: no items")
    try:  # fast path: one C-level parse of the whole file
        records = json.loads("[" + ",".join(line for _, line in numbered) + "]")
    except json.JSONDecodeError:
        records = None
    if records is None:
        for lineno, line in numbered:
            try:
                json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
        raise ValueError(f"{path}: invalid JSON lines")  # e.g. a line that only joins badly
    try:
        ids = [r["item_id"] for r in records]
        seqs = [r["tokens"] for r in records]
    except (KeyError, TypeError):
        for (lineno, _), r in zip(numbered, records):
            if not isinstance(r, dict):
                raise ValueError(f"{path}:{lineno}: expected an object, got {r!r}") from None
            for key in ("item_id", "tokens"):
                if key not in r:
                    raise ValueError(f"{path}:{lineno}: missing key {key!r}") from None
        raise
    for (lineno, _), s in zip(numbered, seqs):
        if not isinstance(s, list):
            raise ValueError(f"{path}:{lineno}: 'tokens' must be a list of ints, got {s!r}")
    return ids, seqs
