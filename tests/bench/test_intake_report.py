"""benchmarks/intake_report.py on a made-up burst: the longest request's first and last token, the spread of the
longest requests' first tokens, and the run's end, as a person reading a served run's files would want them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                      "intake_report.py")


def test_reports_when_the_longest_requests_got_their_first_token(tmp_path):
    # 10 requests; the three longest got their first token at 0.1, 0.5 and 0.9 s
    lengths = [5, 1001, 7, 300, 9, 200, 11, 13, 15, 17]
    ttfts = [0.05, 0.1, 0.06, 0.5, 0.07, 0.9, 0.08, 0.09, 0.11, 0.12]
    e2els = [t + n * 0.002 for t, n in zip(ttfts, lengths)]
    path = tmp_path / "requests_head.json"
    path.write_text(json.dumps({"output_lens": lengths, "ttfts": ttfts, "e2els": e2els}))
    done = subprocess.run([sys.executable, SCRIPT, str(path), "--top", "3"], capture_output=True, text=True,
                          timeout=60, check=True)
    line = done.stdout.strip()
    assert line.startswith("head: 10 requests; longest (1001 tokens) first token 0.10 s, last 2.10 s")
    assert "(2.00 ms a token after it)" in line
    assert "the 3 longest: first tokens 0.10-0.90 s" in line and "p50 0.50" in line
    assert line.endswith("run 2.10 s")
