"""The walkthrough runs every step as it says, and leaves no process behind (row 63)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line or environment names ``text`` (Linux /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(pid))
                        break
            except OSError:
                continue
    return found


def test_demo_runs_every_step():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "demo.py"), "-keep"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    out = done.stdout
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    seen = re.findall(r"model sees: (.*)", out)
    seen_error = re.findall(r"model sees \(isError\): (.*)", out)
    for fragment in ("account household holds", "PENDING_APPROVAL", "paid 950.00 to landlord",
                     "INTERRUPTED"):
        assert any(line.startswith(fragment) for line in seen), fragment
    for fragment in ("REJECTED", "DUPLICATE"):
        assert any(line.startswith(fragment) for line in seen_error), fragment
    assert "payments through the proxy: 1" in out
    assert "payments without the proxy: 2" in out
    assert "Every process the demo started has exited." in out
    tmp = re.search(r"The demo's files are in (\S+);", out).group(1)
    try:
        assert processes_mentioning(tmp) == []
    finally:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
