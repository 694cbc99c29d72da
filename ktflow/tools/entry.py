"""The `ktflow` command's entry point: Ctrl-C at any moment ends with exit status 130 and one
line, while the command line's modules are still importing too (the CLI's own boundary takes over
once they are in)."""

from __future__ import annotations

import importlib
import os
import signal
import sys


def _interrupted(signum, frame) -> None:
    sys.stderr.write("\nktflow: interrupted\n")
    sys.stderr.flush()
    os._exit(130)


#: commands that import torch and numpy (imported here, where an interrupt is one line whatever
#: it lands in: a library half imported by an interrupt can fail later in odd ways)
TORCH_COMMANDS = {"run", "serve", "compile", "demo", "profile", "calibrate", "hw", "inspect", "diff"}


def main() -> int:
    signal.signal(signal.SIGINT, _interrupted)
    from . import cli

    if len(sys.argv) > 1 and sys.argv[1] in TORCH_COMMANDS:
        for name in ("numpy", "torch"):
            importlib.import_module(name)
    cli.EXIT_AT_ONCE = True  # the process ends with the interrupt: no cleanup that a second Ctrl-C could cut
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here the CLI's boundary says it
    return cli.main()
