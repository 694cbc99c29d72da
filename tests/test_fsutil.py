"""Atomic writes: whole or nothing for files; devices and FIFOs written in place, never renamed over."""

import os
import stat
import threading

import pytest

from ktflow.errors import ConfigError
from ktflow.util.fsutil import write_atomic


def test_a_file_is_replaced_whole_and_no_temporary_is_left(tmp_path):
    p = tmp_path / "out.json"
    p.write_text("old")
    write_atomic(p, "new")
    assert p.read_text() == "new" and sorted(x.name for x in tmp_path.iterdir()) == ["out.json"]


def test_a_character_device_is_written_in_place_not_renamed_over(tmp_path):
    before = os.stat("/dev/null")
    write_atomic("/dev/null", "plan")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino


def test_a_fifo_is_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    write_atomic(fifo, b"through the pipe")
    reader.join(timeout=10)
    assert got == [b"through the pipe"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.parametrize("bad,message", [("", "the output path is empty"), (".", "is a directory")])
def test_an_empty_path_or_a_directory_is_refused(tmp_path, bad, message):
    with pytest.raises(ConfigError, match=message):
        write_atomic(bad, "x")


def test_a_socket_path_is_refused(tmp_path):
    import socket

    path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    try:
        with pytest.raises(ConfigError, match="not a regular file"):
            write_atomic(path, "x")
    finally:
        s.close()


def test_a_dead_writers_temporary_file_is_swept_and_a_live_ones_kept(tmp_path):
    import subprocess
    import sys

    p = tmp_path / "plan.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f".plan.json.{dead}.abc123.tmp"
    live = tmp_path / f".plan.json.{os.getppid()}.def456.tmp"
    stale.write_text("half")
    live.write_text("in progress")
    write_atomic(p, "whole")
    assert p.read_text() == "whole" and not stale.exists() and live.exists()
