"""The workload registry: every module of `boundgen.workloads` that defines `WORKLOAD` (a
`Workload`: kind, request dataclass, pipeline builder) is a workload, so a new one is one new file
plus its test.

Modules are imported on first use, not when the package is (mini-sglang's lazy registry).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from boundgen.runtime.dag import Pipeline
from boundgen.workloads.base import Workload, WorkloadContext


@functools.cache
def workloads() -> dict[str, Workload]:
    """kind → `Workload`, for every workload module of this package."""
    import boundgen.workloads as package

    found: dict[str, Workload] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        workload = getattr(module, "WORKLOAD", None)
        if isinstance(workload, Workload):
            if workload.kind in found:
                raise RuntimeError(f"two workload modules register kind {workload.kind!r}")
            found[workload.kind] = workload
    return found


def build_pipelines(context: WorkloadContext) -> dict[str, Pipeline]:
    """One pipeline per registered workload, all sharing `context` (and so its forward node)."""
    return {kind: w.build(context) for kind, w in workloads().items()}
