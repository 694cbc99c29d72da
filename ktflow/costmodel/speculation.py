"""What speculative decoding with a checkpoint's multi-token-prediction (MTP) layer gains, priced
from compiled steps.

A speculative step drafts k tokens (k chained MTP steps) and verifies them in one main-model step
over k + 1 tokens. With the draft at depth d kept with probability a_d given the ones before it
were (the acceptance rates by depth), and the first rejection ending the step, a step yields
E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens. It takes t_verify(k + 1) + k * t_draft.
Against plain decoding at t_decode a token, the gain is

    gain(k) = E(k) * t_decode / (t_verify(k + 1) + k * t_draft).

The verification step reads the union of its k + 1 tokens' experts: with routed experts in CPU
memory that is what decides (for DeepSeek-V3, 256 experts top-8, two independent tokens read
about 15.8 distinct experts against 8). The compile driver (passes/speculation.py) prices it by
compiling a prefill bucket of k + 1 tokens at decode's attention length, the bucket the
verification runs on, its expert reads those of consecutive tokens: with the routing profile's
neighbour co-picks where it has them (neighbouring tokens share experts more often), else as
independent ones (an upper bound). `choose` keeps the k of the largest gain, and k = 0 (plain
decoding) unless that gain passes 1 + MARGIN: speculation has to pay for itself.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

#: speculation is chosen only where its predicted gain passes 1 + MARGIN
MARGIN = 0.05

#: the most chained drafts a step the compile prices
MAX_DRAFTS = 4


def tokens_per_step(k: int, acceptance: list[float]) -> float:
    """E(k): the tokens a step of k drafts yields, the draft at depth d kept with probability
    acceptance[d - 1] (the last rate for deeper ones) until the first rejection; the
    verification's own token always counts."""
    total, kept = 1.0, 1.0
    for d in range(k):
        kept *= acceptance[min(d, len(acceptance) - 1)]
        total += kept
    return total


class SpeculationChoice(BaseModel):
    """The compile's decision on speculative decoding (ktflow.passes.compile), as --explain
    prints it: k drafts a step (0: off), from which priced candidates, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    k: int
    #: the drafts' acceptance rates by depth priced with (the last for deeper ones; None: none known)
    acceptance: list[float] | None
    acceptance_source: str  # where they came from: the option, the routing profile, or none
    decode_us: float | None = None  # a plain one-token decode step (batch 1)
    verify_us: dict[int, float] = {}  # k -> the verification step over k + 1 tokens
    draft_us: float | None = None  # one MTP step
    gains: dict[int, float] = {}  # k -> predicted gain
    tokens: dict[int, float] = {}  # k -> the tokens a step priced (measured, else from the rates)
    cause: str
    #: whether sampled requests speculate too: the price leaves out the rejection rule's work (the
    #: target's and the draft's distributions at each position, on the host), which measured slower
    #: than plain sampling (benchmarks/speculative.py), so only greedy requests do
    sampled: bool = False

    def table(self) -> str:
        """The decision and its candidates, as `ktflow compile --explain` prints them."""
        lines = [f"speculative decoding: k = {self.k} ({self.cause})" + ("" if self.sampled or not self.k else
                 "; plain greedy requests only: the others decode plainly (the rejection rule's work is not "
                 "priced)")]
        if self.gains:
            rates = "/".join(f"{a:.2f}" for a in self.acceptance)
            lines.append(f"  plain decode step {self.decode_us / 1e3:.2f} ms, MTP draft step "
                         f"{self.draft_us / 1e3:.2f} ms, acceptance {rates} by depth ({self.acceptance_source})")
            lines.append(f"  {'k':>3s} {'verify ms':>10s} {'tokens/step':>12s} {'gain':>6s}")
            for k, g in sorted(self.gains.items()):
                verify = f"{self.verify_us[k] / 1e3:10.2f}" if k in self.verify_us else f"{'-':>10s}"
                mark = "*" if k == self.k else " "
                lines.append(f"  {mark}{k:>2d} {verify} {self.tokens.get(k, 1.0):12.2f} {g:6.2f}")
        return "\n".join(lines) + "\n"


def choose(acceptance: list[float], source: str, decode_us: float, verify_us: dict[int, float], draft_us: float,
           measured: list[float] | None = None) -> SpeculationChoice:
    """The k of the largest predicted gain among 0 and the priced ones (`verify_us`' keys), 0
    unless its gain passes 1 + MARGIN; the cause names the numbers. A step's tokens: `measured[k -
    1]` (a replayed run's, the routing profile's) where given, else E(k) from the rates."""
    tokens = {k: measured[k - 1] if measured and k <= len(measured) else tokens_per_step(k, acceptance)
              for k in verify_us}
    gains = {0: 1.0, **{k: tokens[k] * decode_us / (v + k * draft_us) for k, v in verify_us.items()}}
    best = max(gains, key=lambda k: (gains[k], -k))
    if best and gains[best] < 1 + MARGIN:
        best = 0
    if best:
        cause = (f"predicted {gains[best]:.2f}x plain decoding: {tokens[best]:.2f} tokens a "
                 f"step of {(verify_us[best] + best * draft_us) / 1e3:.2f} ms against {decode_us / 1e3:.2f} ms a token")
    else:
        top = max((k for k in gains if k), key=lambda k: gains[k], default=None)
        cause = ("no draft length priced" if top is None else
                 f"the best, k = {top}, predicted {gains[top]:.2f}x plain decoding, not above {1 + MARGIN:.2f}x: "
                 f"{tokens[top]:.2f} tokens a step of "
                 f"{(verify_us[top] + top * draft_us) / 1e3:.2f} ms against {decode_us / 1e3:.2f} ms a token")
    return SpeculationChoice(k=best, acceptance=acceptance, acceptance_source=source, decode_us=decode_us,
                             verify_us=verify_us, draft_us=draft_us, gains=gains, tokens={0: 1.0, **tokens},
                             cause=cause)


def off(cause: str, acceptance: list[float] | None = None, source: str = "none") -> SpeculationChoice:
    """k = 0 without pricing, for `cause` (what the runtime or the options do not allow)."""
    return SpeculationChoice(k=0, acceptance=acceptance, acceptance_source=source, cause=cause)
