"""ktflow: a compiler and runtime for huge Mixture-of-Experts models on one workstation.

    model = ktflow.load("path/to/hf-checkpoint")
    compiled = ktflow.compile(model, hw="cpu", max_seq_len=2048)
    logits, state = ktflow.execute(compiled, input_ids)          # prefill
    logits, state = ktflow.execute(compiled, next_ids, state)    # decode
    out = ktflow.generate(compiled, input_ids, max_new_tokens=32)
"""

from .api import Compiled, compile, decode_greedy, decode_tokens, execute, generate, start_sampling
from .backends.sampling import SamplingParams
from .errors import ConfigError, InputError, KtflowError, PassError, PlanError, WeightError
from .hw import HwProfile
from .model import Model, load
from .runtime.state import State
from .version import __version__

__all__ = ["Compiled", "compile", "execute", "decode_greedy", "decode_tokens", "generate", "start_sampling",
           "SamplingParams", "load", "Model", "State", "HwProfile",
           "KtflowError", "ConfigError", "InputError", "PassError", "PlanError", "WeightError", "__version__"]
