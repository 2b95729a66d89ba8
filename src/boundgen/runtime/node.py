"""Nodes: one step of a business request (tokenize, pack, forward, post-process, business logic).

A `Node` wraps a plain Python callable with named, typed input and output ports and a kind: `CPU`
nodes run on the executor's worker threads (inline where possible), `DEVICE` nodes run under a CUDA
stream from the stream pool with events as edges (plain CPU calls when CUDA is absent).

Values flow by name: a node's input port reads the value of the same name (or the name given in
`bind`), which is either a pipeline input or exactly one node's output.
"""

from __future__ import annotations

import enum
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class NodeKind(str, enum.Enum):
    CPU = "cpu"
    DEVICE = "device"


class PipelineError(ValueError):
    """A pipeline or node definition is invalid (raised when it is built, never while serving)."""


def _type_name(tp: Any) -> str:
    if tp is Any:
        return "Any"
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__qualname__
    return repr(tp).replace("typing.", "")


def _origin(tp: Any) -> Any:
    return typing.get_origin(tp) or tp


def types_compatible(produced: Any, expected: Any) -> bool:
    """True when a value declared as `produced` may feed a port declared as `expected`.

    Deliberately loose on generics (list[int] feeds list[Any] and list) and strict on plain classes.
    """
    if produced is Any or expected is Any or expected is object:
        return True
    if isinstance(expected, typing.TypeVar) or isinstance(produced, typing.TypeVar):
        return True
    if _origin(expected) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(types_compatible(produced, e) for e in typing.get_args(expected))
    if _origin(produced) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return all(types_compatible(p, expected) for p in typing.get_args(produced))
    po, eo = _origin(produced), _origin(expected)
    if not (isinstance(po, type) and isinstance(eo, type)):
        return produced == expected
    if not issubclass(po, eo):
        return False
    pa, ea = typing.get_args(produced), typing.get_args(expected)
    if not pa or not ea or len(pa) != len(ea):
        return True
    return all(
        types_compatible(p, e) for p, e in zip(pa, ea) if p is not Ellipsis and e is not Ellipsis
    )


def _as_ports(spec: Any, what: str, node: str) -> dict[str, Any]:
    if spec is None:
        return {}
    if isinstance(spec, str):
        return {spec: Any}
    if isinstance(spec, dict):
        return dict(spec)
    if isinstance(spec, (list, tuple)):
        ports: dict[str, Any] = {}
        for item in spec:
            if isinstance(item, str):
                ports[item] = Any
            else:
                name, tp = item
                ports[name] = tp
        return ports
    raise PipelineError(
        f"node {node!r}: {what} must be a name, a list of names or a dict name -> type"
    )


@dataclass(eq=False)
class Node:
    """One step of a pipeline.

    `fn(**inputs)` returns the single output's value, or (for several outputs) a tuple in declared
    order or a dict by name. When `fn` has a parameter named `ctx`, it also receives the request's
    `RequestContext`
    (deadline, stream, memory pools). Safe to share between pipelines and threads when `fn` is.
    """

    name: str
    fn: Callable[..., Any]
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    kind: NodeKind = NodeKind.CPU
    bind: dict[str, str] = field(default_factory=dict)
    wants_ctx: bool = False
    # Set for asynchronous nodes (the batching node): start(ctx, inputs, done) instead of
    # fn(**inputs).
    is_async: bool = False
    # Exception types that fail the request as themselves (e.g. ValueError from input validation, so
    # a server can answer 4xx) instead of being wrapped in NodeError; a note names the node.
    raises: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise PipelineError(
                f"node name must be a non-empty string without '.', got {self.name!r}"
            )
        if not callable(self.fn):
            raise PipelineError(
                f"node {self.name!r}: fn must be callable, got {type(self.fn).__name__}"
            )
        self.kind = NodeKind(self.kind)
        self.inputs = _as_ports(self.inputs, "inputs", self.name)
        self.outputs = _as_ports(self.outputs, "outputs", self.name)
        if not self.outputs:
            raise PipelineError(f"node {self.name!r} declares no outputs")
        for port in self.bind:
            if port not in self.inputs:
                raise PipelineError(
                    f"node {self.name!r}: bind names unknown input port {port!r} "
                    f"(inputs: {', '.join(self.inputs) or 'none'})"
                )
        self._output_names = tuple(self.outputs)
        self._result_keys = self._output_names

    def source(self, port: str) -> str:
        """The value name that feeds input `port`."""
        return self.bind.get(port, port)

    def call(self, args: dict[str, Any], ctx: Any) -> tuple[Any, ...]:
        """Run `fn` and return the outputs as a tuple in declared order."""
        if self.wants_ctx:
            result = self.fn(ctx=ctx, **args)
        else:
            result = self.fn(**args)
        names = self._result_keys
        if len(names) == 1:
            return (result,)
        if isinstance(result, dict):
            try:
                return tuple(result[n] for n in names)
            except KeyError as exc:
                raise TypeError(
                    f"returned a dict without output {exc.args[0]!r} (outputs: {', '.join(names)})"
                ) from None
        if isinstance(result, tuple) and len(result) == len(names):
            return result
        raise TypeError(
            f"must return a tuple of {len(names)} values or a dict with keys {', '.join(names)}, "
            f"got {type(result).__name__}"
        )

    def renamed(
        self, name: str, bind: dict[str, str] | None = None, outputs: dict[str, str] | None = None
    ) -> Node:
        """A copy under another name, with inputs re-bound and outputs renamed (`{old: new}`)."""
        outs = {(outputs or {}).get(k, k): v for k, v in self.outputs.items()}
        copy = Node(
            name=name,
            fn=self.fn,
            inputs=dict(self.inputs),
            outputs=outs,
            kind=self.kind,
            bind={**self.bind, **(bind or {})},
            wants_ctx=self.wants_ctx,
            is_async=self.is_async,
            raises=self.raises,
        )
        copy._result_keys = self._result_keys  # a dict result still uses the function's own names
        return copy

    def __repr__(self) -> str:
        ins = ", ".join(f"{k}: {_type_name(v)}" for k, v in self.inputs.items())
        outs = ", ".join(f"{k}: {_type_name(v)}" for k, v in self.outputs.items())
        return f"Node({self.name!r}, {self.kind.value}, ({ins}) -> ({outs}))"


def node_from_function(
    fn: Callable[..., Any],
    name: str | None = None,
    outputs: Any = None,
    kind: NodeKind | str = NodeKind.CPU,
    bind: dict[str, str] | None = None,
    raises: tuple[type[BaseException], ...] = (),
) -> Node:
    """Make a `Node` from a plain function: inputs are its parameters (types from annotations, `Any`
    when missing), outputs default to one value named after the function with its return annotation.

    ```python
    def top_n(scores: list[float], n: int) -> list[int]:
        return sorted(range(len(scores)), key=scores.__getitem__, reverse=True)[:n]

    node = node_from_function(top_n, outputs="top")
    ```
    """
    name = name or fn.__name__
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable forward references: fall back to Any
        hints = {}
    sig = inspect.signature(fn)
    inputs: dict[str, Any] = {}
    wants_ctx = False
    for p in sig.parameters.values():
        if p.name == "ctx":
            wants_ctx = True
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise PipelineError(
                f"node {name!r}: *args/**kwargs parameters cannot be bound to values"
            )
        inputs[p.name] = hints.get(p.name, Any)
    ret = hints.get("return", Any)
    if outputs is None:
        outputs = {name: ret}
    elif isinstance(outputs, str):
        outputs = {outputs: ret}
    elif isinstance(outputs, (list, tuple)) and all(isinstance(o, str) for o in outputs):
        rargs = typing.get_args(ret) if _origin(ret) is tuple else ()
        if len(rargs) == len(outputs) and Ellipsis not in rargs:
            outputs = dict(zip(outputs, rargs))
        else:
            outputs = dict.fromkeys(outputs, Any)
    return Node(
        name=name,
        fn=fn,
        inputs=inputs,
        outputs=outputs,
        kind=kind,
        bind=dict(bind or {}),
        wants_ctx=wants_ctx,
        raises=tuple(raises),
    )


def node(
    name: str | None = None,
    outputs: Any = None,
    kind: NodeKind | str = NodeKind.CPU,
    bind: dict[str, str] | None = None,
    raises: tuple[type[BaseException], ...] = (),
) -> Callable[[Callable[..., Any]], Node]:
    """Decorator form of `node_from_function`."""

    def wrap(fn: Callable[..., Any]) -> Node:
        return node_from_function(
            fn, name=name, outputs=outputs, kind=kind, bind=bind, raises=raises
        )

    return wrap
