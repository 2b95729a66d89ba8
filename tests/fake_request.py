"""What a batching node reads of the executor's request, for tests that drive a node directly."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FakeRequest:
    request_id: int
    deadline_ns: int | None = None
    timeout_ms: float = 0.0
    pipeline: str = "fake"
    failed: bool = False
    executor: object = field(default_factory=lambda: type("Ex", (), {"cuda": False})())

    def alive(self) -> bool:
        return not self.failed
