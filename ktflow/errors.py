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
    """A step produced a NaN or an infinity (found by the check_finite run option)."""

    exit_code = 1
