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
    assert 0 <= got["gil_trips_per_request"] <= got["torch_calls_per_request"]
