"""Errors ktflow raises for bad input. Each message names the thing that was wrong and, where
there is one, how to fix it. The CLI prints them without a traceback and exits non-zero."""


class KtflowError(Exception):
    """Base class of ktflow's user-facing errors."""


class ConfigError(KtflowError):
    """The model directory or its config.json is unusable."""


class WeightError(KtflowError):
    """A checkpoint tensor is missing, mis-shaped, of the wrong dtype, or a file is corrupt."""


class PlanError(KtflowError):
    """A plan file is unreadable or belongs to another model or ktflow version."""


class InputError(KtflowError):
    """Token ids or lengths that the model or the plan cannot take."""


class PassError(KtflowError):
    """A compiler pass failed; the message names the pass and the passes before it."""
