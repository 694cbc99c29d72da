"""ktflow: a compiler and runtime for huge Mixture-of-Experts models on one workstation.

    model = ktflow.load("path/to/hf-checkpoint")
    compiled = ktflow.compile(model, hw="cpu", max_seq_len=2048)
    logits, state = ktflow.execute(compiled, input_ids)          # prefill
    logits, state = ktflow.execute(compiled, next_ids, state)    # decode
    out = ktflow.generate(compiled, input_ids, max_new_tokens=32)

The names that run things (and need torch) load on first use: `import ktflow.ir` or
`ktflow.passes` (the compiler's IR and passes) needs no torch.
"""

from importlib import import_module
from importlib.util import find_spec

from .errors import ConfigError, InputError, KtflowError, PassError, PlanError, WeightError
from .version import __version__

#: the public names loaded on first use, and their modules
_LAZY = {**dict.fromkeys(("Compiled", "compile", "decode_greedy", "decode_tokens", "execute", "generate",
                          "start_sampling"), ".api"),
         "SamplingParams": ".backends.sampling", "Model": ".frontend.load", "load": ".frontend.load", "State": ".runtime.state",
         "stream": ".api", "chat": ".serve.chat", "HwProfile": ".costmodel.hw"}

__all__ = ["Compiled", "compile", "execute", "decode_greedy", "decode_tokens", "generate", "stream", "chat",
           "start_sampling",
           "SamplingParams", "load", "Model", "State", "HwProfile",
           "KtflowError", "ConfigError", "InputError", "PassError", "PlanError", "WeightError", "__version__"]


def __getattr__(name: str):
    """A lazy public name, or a submodule (`ktflow.api`, `ktflow.backends.native.binding`, ...) imported on use."""
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
    elif not name.startswith("__") and find_spec(f"{__name__}.{name}") is not None:
        value = import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'ktflow' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_LAZY})
