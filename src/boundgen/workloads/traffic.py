"""The shapes of the model forwards a process runs, logged for `boundgen compile --from-traffic`.

One JSON line per forward — the groups the forward node received after the batching node merged
requests, before any split or packing — as lengths only, never tokens:

    {"groups": [[256, [16, 16, 17]], [0, [120, 88]]], "share_prefix": true}
    {"groups": [[0, [128, 131]]], "share_prefix": false, "kind": "beam"}

`share_prefix` is how the runner packs them (false when a row wants mean or per-token pooling);
beam searches log their prompt prefill with `"kind": "beam"`. `compile.planner.load_traffic` reads
the file back. A line is ~10 bytes per sequence; the file is opened at start-up (a bad path fails
then, not at the first request) and written line by line, so a crash loses at most one forward.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from boundgen.text.packing import SequenceGroup


class TrafficLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise ValueError(f"cannot write the traffic log {self.path}: {exc}") from None
        self._lock = threading.Lock()

    def forward(
        self, groups: list[SequenceGroup], share_prefix: bool, kind: str | None = None
    ) -> None:
        record: dict = {
            "groups": [[len(g.prefix), [len(s) for s in g.suffixes]] for g in groups],
            "share_prefix": share_prefix,
        }
        if kind is not None:
            record["kind"] = kind
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()
