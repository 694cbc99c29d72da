"""Every environment variable ktflow reads, in one table, and the only place that reads them.

Each entry has a kind (flag, int, text, path), a default and one line of meaning; `get(name)`
returns the parsed value, and a value that does not parse is a ConfigError naming the variable.
`docs/env.md` lists the same table (a test keeps the two equal: `python -m ktflow.util.env`
prints it). The native library reads its three (KTFLOW_SPIN_US, KTFLOW_NATIVE_ISA,
KTFLOW_HUGEPAGES) itself; they are listed here for the record.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: Literal["flag", "int", "text", "path"]
    default: str
    meaning: str
    lo: int | None = None  # an int's least value
    hi: int | None = None  # an int's largest value
    choices: tuple[str, ...] = ()  # a text's values (empty: any)


VARIABLES = {v.name: v for v in (
    EnvVar("KTFLOW_DEBUG", "flag", "0", "show tracebacks for errors the CLI would print in one line"),
    EnvVar("KTFLOW_QUIET", "flag", "0", "no progress bars or notices on stderr"),
    EnvVar("KTFLOW_DUMP", "path", "", "write the graph after every compiler pass into this folder"),
    EnvVar("KTFLOW_CHECK_FINITE", "flag", "0", "check every step's outputs for NaN/inf and name the first node "
                                              "that made one (slow: for debugging)"),
    EnvVar("KTFLOW_CACHE", "path", "", "where `ktflow demo` keeps its generated model (default: "
                                       "$XDG_CACHE_HOME/ktflow or ~/.cache/ktflow)"),
    EnvVar("KTFLOW_CACHE_DIR", "text", "", "where packed CPU experts are cached on disk (a path, default "
                                           "~/.cache/ktflow/packed; 'off': no cache, pack at every load)"),
    EnvVar("KTFLOW_THREADS", "int", "0", "native worker threads (0: every CPU but the ones the GPU driver needs)",
           lo=0, hi=4096),
    EnvVar("KTFLOW_NUMA_GROUPS", "int", "0", "native worker groups, one per NUMA node (0: as the machine has)",
           lo=0, hi=1024),
    EnvVar("KTFLOW_PIN", "flag", "1", "pin native workers and the Python thread to CPUs (0: let the OS move them)"),
    EnvVar("KTFLOW_SPIN_US", "int", "1000", "microseconds idle native workers spin before they sleep (read by "
                                            "the native library)", lo=0, hi=10_000_000),
    EnvVar("KTFLOW_NATIVE_ISA", "text", "", "cap the native kernels' instruction set: generic, avx512 or amx (read "
                                            "by the native library; default: what the CPU has)",
           choices=("generic", "avx512", "amx")),
    EnvVar("KTFLOW_HUGEPAGES", "flag", "1", "ask for transparent huge pages over native arenas (read by the native "
                                            "library)"),
    EnvVar("KTFLOW_API_KEY", "text", "", "the key `ktflow serve` requires of clients (--api-key)"),
    EnvVar("KTFLOW_RANK_TIMEOUT", "int", "600", "seconds a rank of a several-GPU run waits on the others (a "
                                                "collective, the start) before it fails", lo=1, hi=10_000_000),
)}


def get(name: str):
    """The variable's value, parsed by its kind (flag -> bool, int -> int, text/path -> str; an unset
    or empty variable gives the default's parse)."""
    var = VARIABLES[name]
    raw = os.environ.get(name, "")
    if raw == "":
        raw = var.default
    if var.kind == "flag":
        if raw.lower() in ("", "0", "false", "no", "off"):
            return False
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        raise ConfigError(f"environment variable {name}={raw!r}: use 1 or 0 ({var.meaning})")
    if var.kind == "int":
        try:
            v = int(raw or 0)
        except ValueError:
            raise ConfigError(f"environment variable {name}={raw!r}: not an integer ({var.meaning})") from None
        if (var.lo is not None and v < var.lo) or (var.hi is not None and v > var.hi):
            raise ConfigError(f"environment variable {name}={raw!r}: must be in [{var.lo}, {var.hi}] ({var.meaning})")
        return v
    if var.choices and raw and raw not in var.choices:
        raise ConfigError(f"environment variable {name}={raw!r}: one of {', '.join(var.choices)} ({var.meaning})")
    return raw


def put(name: str, value: str) -> None:
    """Set registered variable `name` for this process and the ones it starts."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a registered variable")
    os.environ[name] = value


#: the variables the native library reads itself (checked here before it is used)
NATIVE = ("KTFLOW_SPIN_US", "KTFLOW_NATIVE_ISA", "KTFLOW_HUGEPAGES")


def check_native() -> None:
    """ConfigError for a native library variable that does not parse or is out of range."""
    for name in NATIVE:
        get(name)


def table() -> str:
    """The registry as a markdown table (docs/env.md's)."""
    rows = ["| variable | kind | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.kind} | {v.default or '—'} | {v.meaning} |" for v in VARIABLES.values()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
