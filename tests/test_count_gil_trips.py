"""`benchmarks/count_gil_trips.py` on the CPU: a W5 request's torch calls outside the model, each
timed beside a busy thread. (Which of them give the GIL up is read from those times, which depend
on the machine's load: not asserted here.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_score_request_s_gil_trips_are_counted(tmp_path):
    out = tmp_path / "trips.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "count_gil_trips.py"), "--requests", "4"]
    cmd += ["--root", str(tmp_path / "model"), "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["backend"] == "eager"
    calls = {(c["caller"], c["call"]): c for c in got["calls"]}
    for head_call in (("runner.py:label_logits", "linear"), ("score.py:request_scores", "softmax")):
        assert calls[head_call]["per_request"] == 1
        assert calls[head_call]["median_ms_beside_busy"] is not None
    assert ("decoder.py:logits", "index_select") not in calls  # the label rows are kept
    trips = got["gil_trips_per_request"] + got["gil_trips_sometimes_per_request"]
    assert 0 <= trips <= got["torch_calls_per_request"]


def test_a_call_that_takes_the_gil_straight_back_mostly_still_counts():
    """The median hides a call that gives the GIL up but mostly takes it straight back (`.cpu()`
    beside a busy thread: 4–8 % of its calls over 1 ms): two such calls make it "sometimes"."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from count_gil_trips import release_kind

    fast, slow = 0.00002, 0.0052  # seconds: a C helper's, a wait for the switch interval
    assert release_kind([fast] * 10) is None
    assert release_kind([fast] * 9 + [slow]) is None  # once: a preemption as likely
    assert release_kind([fast] * 48 + [slow] * 2) == "sometimes"
    assert release_kind([slow] * 6 + [fast] * 4) == "always"
    assert release_kind([]) is None
