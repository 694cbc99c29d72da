"""What every benchmark records beside its numbers: the commit, the machine, and JSONL output."""

from __future__ import annotations

import json
import platform
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).parent


def commit() -> str:
    """The short commit of the working tree, with '+dirty' when it has uncommitted changes;
    KTFLOW_COMMIT overrides it (a copied tree whose .git is not the one it came from)."""
    if os.environ.get("KTFLOW_COMMIT"):
        return os.environ["KTFLOW_COMMIT"]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=HERE).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=HERE).stdout.strip()
    except OSError:
        return "unknown"
    return (rev + ("+dirty" if dirty else "")) if rev else "unknown"


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # whether the native expert arenas asked for transparent huge pages (KTFLOW_HUGEPAGES=0: not)
    return dict(machine=platform.node(), cpu=cpu, hugepages=os.environ.get("KTFLOW_HUGEPAGES", "1") != "0")


def append_jsonl(path: str | Path, rows: list[dict]) -> None:
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"appended {len(rows)} rows to {path}")
