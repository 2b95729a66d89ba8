"""Static pipelines: a DAG of nodes validated once when built, then compiled into an index-based
plan.

Values are named: a pipeline input or a node output. Every value has exactly one producer; every
node input reads one value. Validation (at build time, never while serving) rejects duplicate
node names, duplicate outputs, unbound inputs, unknown names, type mismatches and cycles, naming
the nodes and ports involved.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from boundgen.runtime.node import (
    Node,
    NodeKind,
    PipelineError,
    _type_name,
    node_from_function,
    types_compatible,
)


@dataclass(frozen=True)
class _NodePlan:
    """A node compiled to slot indices (one slot per value)."""

    index: int
    node: Node
    arg_names: tuple[str, ...]
    arg_slots: tuple[int, ...]
    out_slots: tuple[int, ...]
    successors: tuple[int, ...]
    num_preds: int  # distinct producer nodes this node waits for (0: starts with the request)


class Pipeline:
    """A static DAG: `Pipeline(name, inputs={...}, nodes=[...], outputs=[...])`.

    `inputs` maps pipeline input names to types; `outputs` lists the value names returned (a dict),
    or maps returned names to value names. Immutable after construction; `extend` returns a new
    pipeline.
    """

    def __init__(
        self,
        name: str,
        inputs: dict[str, Any] | Iterable[str],
        nodes: Iterable[Node],
        outputs: Iterable[str] | dict[str, str],
        defaults: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.defaults: dict[str, Any] = dict(defaults or {})
        self.inputs: dict[str, Any] = (
            dict(inputs) if isinstance(inputs, dict) else dict.fromkeys(inputs, Any)
        )
        self.nodes: tuple[Node, ...] = tuple(nodes)
        self.outputs: dict[str, str] = (
            dict(outputs) if isinstance(outputs, dict) else {n: n for n in outputs}
        )
        self._validate()
        self._compile()

    # ---- validation
    # ------------------------------------------------------------------------------------

    def _err(self, msg: str) -> PipelineError:
        return PipelineError(f"pipeline {self.name!r}: {msg}")

    def _validate(self) -> None:
        if not self.nodes:
            raise self._err("has no nodes")
        for k in self.defaults:
            if k not in self.inputs:
                raise self._err(
                    f"default given for unknown input {k!r} (inputs: {', '.join(self.inputs)})"
                )
        seen: set[str] = set()
        for n in self.nodes:
            if not isinstance(n, Node):
                raise self._err(f"expected Node objects, got {type(n).__name__} ({n!r})")
            if n.name in seen:
                raise self._err(f"duplicate node name {n.name!r}")
            if n.name in self.inputs:
                raise self._err(f"node {n.name!r} has the same name as a pipeline input")
            seen.add(n.name)

        # value name -> (producer description, type, producer node name or None for pipeline inputs)
        producers: dict[str, tuple[str, Any, str | None]] = {
            v: (f"pipeline input {v!r}", t, None) for v, t in self.inputs.items()
        }
        for n in self.nodes:
            for out, tp in n.outputs.items():
                if out in producers:
                    raise self._err(
                        f"duplicate output {out!r}: produced by node {n.name!r} and by "
                        f"{producers[out][0]}"
                    )
                producers[out] = (f"node {n.name!r}", tp, n.name)
        self._producers = producers

        for n in self.nodes:
            for port, expected in n.inputs.items():
                src = n.source(port)
                if src not in producers:
                    near = _closest(src, producers)
                    raise self._err(
                        f"node {n.name!r} input {port!r} is unbound: no pipeline input or node "
                        "output named "
                        f"{src!r}" + (f" (did you mean {near!r}?)" if near else "")
                    )
                desc, produced, _ = producers[src]
                if not types_compatible(produced, expected):
                    raise self._err(
                        f"type mismatch: node {n.name!r} input {port!r} expects "
                        f"{_type_name(expected)}, "
                        f"but {desc} produces {src!r} as {_type_name(produced)}"
                    )
        for ret, src in self.outputs.items():
            if src not in producers:
                near = _closest(src, producers)
                raise self._err(
                    f"output {ret!r} names unknown value {src!r}"
                    + (f" (did you mean {near!r}?)" if near else "")
                )
        self._order = self._toposort()

    def _toposort(self) -> list[Node]:
        by_name = {n.name: n for n in self.nodes}
        deps: dict[str, list[str]] = {}
        for n in self.nodes:
            ds = []
            for port in n.inputs:
                prod = self._producers[n.source(port)][2]
                if prod is not None and prod not in ds:
                    ds.append(prod)
            deps[n.name] = ds
        state: dict[str, int] = {}  # 1 visiting, 2 done
        order: list[Node] = []
        for root in by_name:
            if state.get(root) == 2:
                continue
            stack: list[tuple[str, int]] = [(root, 0)]
            path: list[str] = []
            while stack:
                name, i = stack.pop()
                if i == 0:
                    if state.get(name) == 2:
                        continue
                    state[name] = 1
                    path.append(name)
                ds = deps[name]
                if i < len(ds):
                    stack.append((name, i + 1))
                    d = ds[i]
                    if state.get(d) == 1:
                        cycle = path[path.index(d) :] + [d]
                        raise self._err("cycle: " + " -> ".join(reversed(cycle)))
                    if state.get(d) != 2:
                        stack.append((d, 0))
                else:
                    state[name] = 2
                    path.pop()
                    order.append(by_name[name])
        return order

    # ---- compiled plan
    # ---------------------------------------------------------------------------------

    def _compile(self) -> None:
        slot_of: dict[str, int] = {}
        for v in self.inputs:
            slot_of[v] = len(slot_of)
        for n in self._order:
            for out in n.outputs:
                slot_of[out] = len(slot_of)
        index_of = {n.name: i for i, n in enumerate(self._order)}
        succ: list[list[int]] = [[] for _ in self._order]
        plans = []
        for i, n in enumerate(self._order):
            preds: list[int] = []
            for port in n.inputs:
                prod = self._producers[n.source(port)][2]
                if prod is not None and index_of[prod] not in preds:
                    preds.append(index_of[prod])
            for p in preds:
                succ[p].append(i)
            plans.append((i, n, preds))
        self.plan: tuple[_NodePlan, ...] = tuple(
            _NodePlan(
                index=i,
                node=n,
                arg_names=tuple(n.inputs),
                arg_slots=tuple(slot_of[n.source(p)] for p in n.inputs),
                out_slots=tuple(slot_of[o] for o in n.outputs),
                successors=tuple(succ[i]),
                num_preds=len(preds),
            )
            for i, n, preds in plans
        )
        self.num_slots = len(slot_of)
        self.input_slots: tuple[tuple[str, int], ...] = tuple((v, slot_of[v]) for v in self.inputs)
        self.output_slots: tuple[tuple[str, int], ...] = tuple(
            (ret, slot_of[src]) for ret, src in self.outputs.items()
        )
        self.sources: tuple[int, ...] = tuple(p.index for p in self.plan if p.num_preds == 0)
        self.slot_producer: tuple[int, ...] = tuple(
            [-1] * len(self.inputs) + [p.index for p in self.plan for _ in p.out_slots]
        )
        self.join_template: list = [p.num_preds > 1 for p in self.plan]
        self.has_joins = any(self.join_template)
        if not self.has_joins:
            self.join_template = [None] * len(self.plan)  # shared, never written
        self.node_by_name: dict[str, Node] = {n.name: n for n in self.nodes}
        self.has_device_nodes = any(p.node.kind is NodeKind.DEVICE for p in self.plan)

    # ---- building new pipelines
    # ------------------------------------------------------------------------

    def extend(
        self,
        *nodes: Node | Any,
        outputs: Iterable[str] | dict[str, str] | None = None,
        name: str | None = None,
    ) -> Pipeline:
        """A new pipeline with `nodes` added (plain functions become CPU nodes) and, optionally, new
        outputs.

        This is how users append business post-logic (calibration, filtering, top-n) to a
        built-in pipeline.
        """
        extra = [n if isinstance(n, Node) else node_from_function(n) for n in nodes]
        return Pipeline(
            name or self.name,
            self.inputs,
            list(self.nodes) + extra,
            self.outputs if outputs is None else outputs,
            self.defaults,
        )

    def with_inputs(self, defaults: dict[str, Any] | None = None, **types: Any) -> Pipeline:
        """A new pipeline with extra pipeline inputs (e.g. a business parameter for a user node),
        optionally with default values used when a request leaves them out."""
        return Pipeline(
            self.name,
            {**self.inputs, **types},
            self.nodes,
            self.outputs,
            {**self.defaults, **(defaults or {})},
        )

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, nodes={[n.name for n in self._order]})"


def _closest(name: str, candidates: Iterable[str]) -> str | None:
    import difflib

    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None
