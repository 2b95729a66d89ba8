"""Static DAG runtime: a business request is one pipeline of nodes run by worker threads and CUDA
streams.

```python
from boundgen.runtime import Executor, Pipeline, node

@node(outputs="tokens")
def tokenize(text: str) -> list[int]: ...

pipe = Pipeline("demo", inputs={"text": str}, nodes=[tokenize, ...], outputs=["scores"])
with Executor() as ex:
    out = ex.run(pipe, {"text": "hi"}, timeout_ms=20)
```
See docs/runtime.md.
"""

from boundgen.runtime.batching import BatchingNode
from boundgen.runtime.dag import Pipeline
from boundgen.runtime.executor import (
    DeadlineExceeded,
    Executor,
    ExecutorClosed,
    NodeError,
    NodeTime,
    RequestContext,
    RequestFuture,
    RuntimeRequestError,
    call_directly,
)
from boundgen.runtime.memory import BufferPool, Lease, MemoryPools, bucket_for
from boundgen.runtime.node import (
    Node,
    NodeKind,
    PipelineError,
    node,
    node_from_function,
)
from boundgen.runtime.trace import LatencyHistogram, RequestTrace, Span, Tracer, chrome_trace

__all__ = [
    "BatchingNode",
    "BufferPool",
    "DeadlineExceeded",
    "Executor",
    "ExecutorClosed",
    "LatencyHistogram",
    "Lease",
    "MemoryPools",
    "Node",
    "NodeError",
    "NodeKind",
    "NodeTime",
    "Pipeline",
    "PipelineError",
    "RequestContext",
    "RequestFuture",
    "RequestTrace",
    "RuntimeRequestError",
    "Span",
    "Tracer",
    "bucket_for",
    "call_directly",
    "chrome_trace",
    "node",
    "node_from_function",
]
