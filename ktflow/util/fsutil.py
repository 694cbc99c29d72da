"""File helpers: atomic writes (temporary file in the same directory, fsync, rename) and reading
a pydantic model from a JSON file with errors that name the file and the field."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def read_model_json(cls: type[M], path: str | os.PathLike, what: str) -> M:
    """`cls` from the JSON file at `path`; a ConfigError names `what`, the file and the problem."""
    from ..errors import ConfigError

    p = Path(path)
    try:
        return cls.model_validate(json.loads(p.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"{what} {p} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {p} is a directory, not a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{what} {p} is not valid JSON ({e})") from None
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, er['loc']))}: {er['msg']}" for er in e.errors())
        raise ConfigError(f"{what} {p} is malformed: {problems}") from None


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write `data` to `path` whole or not at all (a temporary file beside it, named with this
    process's id, fsynced, renamed). A path that names a character device or a FIFO (/dev/null,
    /dev/stdout, a pipe) is written directly: renaming over it would replace the device node."""
    import stat

    from ..errors import ConfigError

    p = Path(path)
    if not str(path):
        raise ConfigError("the output path is empty; give a file path to write")
    if p.is_dir():
        raise ConfigError(f"{p} is a directory; give a file path to write")
    try:
        mode = os.stat(p).st_mode
    except OSError:
        mode = None
    if mode is not None and (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
        with open(p, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        return
    if mode is not None and not stat.S_ISREG(mode):
        raise ConfigError(f"{p} is not a regular file (a socket or a block device); give a file path to write")
    p.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(p)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.{os.getpid()}.", suffix=".tmp", dir=p.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _sweep_stale(p: Path) -> None:
    """Remove temporary files of earlier writes to `p` whose writer is gone (killed mid-write)."""
    for t in p.parent.glob(f".{p.name}.*.tmp"):
        pid = t.name[len(p.name) + 2:].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # no such process: the write died with it
            try:
                t.unlink()
            except OSError:
                pass
        except PermissionError:  # another user's live process
            pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
