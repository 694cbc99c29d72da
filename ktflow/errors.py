"""Errors ktflow raises. Each message names the thing that was wrong and, where there is one,
how to fix it. The CLI prints one line (`ktflow <command>: error: <message>`), no traceback
unless --debug or KTFLOW_DEBUG=1, and exits with the error's `exit_code`: 2 for bad input (a
model dir, config, checkpoint, plan, flag or token ids), 1 for the environment (a path that
cannot be written, a full disk, too little memory, a missing GPU)."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message ('' when it has none): what a one-line error
    quotes from a library's exception."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


class KtflowError(Exception):
    """Base class of ktflow's user-facing errors."""

    exit_code = 2


class ConfigError(KtflowError):
    """The model directory, its config.json, or an option is unusable."""


class CheckpointError(KtflowError):
    """A checkpoint file is unreadable, malformed, or does not match the model."""


class WeightError(CheckpointError):
    """A checkpoint tensor is missing, mis-shaped, of the wrong dtype, non-finite, or its file is
    corrupt."""


class PlanError(KtflowError):
    """A plan file is unreadable, fails verification, or belongs to another model or version."""


class InputError(KtflowError):
    """Token ids or lengths that the model or the plan cannot take."""


class PassError(KtflowError):
    """A compiler pass failed; the message names the pass and the passes before it."""


class ResourceError(KtflowError):
    """The machine cannot do it: too little GPU or host memory, no GPU, a path that cannot be
    written."""

    exit_code = 1


class NumericError(KtflowError):
    """A step produced a NaN or an infinity: in the logits a token is selected from (checked at
    every selection), or in any value with the check_finite run option. `rows`: the rows whose
    logits were not finite; `ids`: the step's selected ids where the others' are still good
    (-1 in those rows)."""

    exit_code = 1

    def __init__(self, message: str, rows: tuple[int, ...] = (), ids=None):
        super().__init__(message)
        self.rows, self.ids = rows, ids


def require_finite(ids, what: str):
    """`ids` as selected (int64, -1 in a row whose logits held a NaN or an infinity: sampling's
    `mark_nonfinite`), or a NumericError naming `what` and those rows, carrying the ids."""
    import torch

    bad = (ids.reshape(ids.shape[0], -1) < 0).any(-1)
    if not bool(bad.any()):
        return ids
    rows = tuple(int(r) for r in torch.nonzero(bad.cpu()).flatten())
    raise NumericError(f"{what}: the logits of row(s) {list(rows)} hold a NaN or an infinity, so no token can be "
                       "selected (the model's values overflowed, or its weights hold non-finite values); run with "
                       "--check-finite and backend='native' to find the first node that makes one", rows=rows, ids=ids)
