"""Value types of the IR: tensor types, placements, costs and weight references.

Everything here is a frozen dataclass made of plain values (ints, floats, strings, tuples), so a
graph can be hashed, compared, printed deterministically and written to JSON without pickling.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

#: The symbolic token dimension: the number of tokens a step processes (batch * sequence).
TOKENS = "T"

Dim = int | str


class DType(str, Enum):
    """Element types. ROUTE is the router's output: (expert ids int64, weights f32) per token."""

    F32 = "f32"
    BF16 = "bf16"
    F16 = "f16"
    I64 = "i64"
    ROUTE = "route"
    TOKEN = "token"  # a submit's completion token: ordering only, no data

    @property
    def itemsize(self) -> int:
        return {"f32": 4, "bf16": 2, "f16": 2, "i64": 8, "route": 12, "token": 0}[self.value]


#: Floating point dtypes a checkpoint or an activation may have.
FLOAT_DTYPES = (DType.F32, DType.BF16, DType.F16)


@dataclass(frozen=True)
class TensorType:
    """Shape (ints, or TOKENS for the per-step token count) and element type of a node's output."""

    shape: tuple[Dim, ...]
    dtype: DType

    def __str__(self) -> str:
        return "[" + ",".join(str(d) for d in self.shape) + "]" + self.dtype.value

    def concrete(self, tokens: int) -> tuple[int, ...]:
        """The shape with the token dimension set to `tokens`."""
        return tuple(tokens if d == TOKENS else int(d) for d in self.shape)

    def numel(self, tokens: int) -> int:
        n = 1
        for d in self.shape:
            n *= tokens if d == TOKENS else int(d)
        return n


class Device(str, Enum):
    CPU = "cpu"
    GPU = "gpu"


@dataclass(frozen=True)
class Placement:
    """Where a node runs and why. `numa` and `stream` are filled by later passes."""

    device: Device
    cause: str = ""
    numa: int | None = None
    stream: str | None = None

    def __str__(self) -> str:
        s = "@" + self.device.value
        if self.numa is not None:
            s += f".numa{self.numa}"
        if self.stream:
            s += f".{self.stream}"
        return s

    @property
    def lane(self) -> str:
        """The plan lane the node runs on: its stream (gpu, copy, fetch), cpu<i> for NUMA node i's
        share of the CPU, else its device."""
        if self.stream:
            return self.stream
        if self.numa is not None:
            return f"cpu{self.numa}"
        return self.device.value


@dataclass(frozen=True)
class Timing:
    """When a scheduled node runs in its plan's step, predicted: us from the step's start."""

    start_us: float
    end_us: float

    def __str__(self) -> str:
        return f"t={self.start_us:.3f}..{self.end_us:.3f}us"


#: the arenas a buffer plan places values in: gpu (device memory), host, pinned (the exchange
#: memory PCIe copies read and write on the host side), staging (GPU buffers streamed expert
#: weights are fetched into)
ARENAS = ("gpu", "host", "pinned", "staging")


@dataclass(frozen=True)
class Buffer:
    """Where a node's value lives in its step (set by the buffer pass): bytes `offset` ..
    `offset + bytes` of `arena`, live from plan instruction `first_instruction` (the writer, or its
    task's submit) to `last_instruction` (its last reader) inclusive.

    per_token: offset and bytes are per token of the step, so one layout serves every step size
    (a step of t tokens places the value at t x offset, t x bytes: scaling keeps disjoint ranges
    disjoint); else they are absolute (streamed expert weights, whose size does not depend on
    the step's tokens)."""

    arena: str
    offset: int
    bytes: int
    first_instruction: int
    last_instruction: int
    per_token: bool = True

    def span(self, tokens: int) -> tuple[int, int]:
        """(offset, bytes) in a step of `tokens` tokens."""
        return (self.offset * tokens, self.bytes * tokens) if self.per_token else (self.offset, self.bytes)

    def __str__(self) -> str:
        unit = "/token" if self.per_token else ""
        return (f"@{self.arena}+{self.offset}:{self.bytes}{unit} "
                f"live {self.first_instruction}..{self.last_instruction}")


@dataclass(frozen=True)
class Cost:
    """Predicted work of one node in one step of the plan's phase, and its time on each device
    (from the cost-annotation pass; `gpu_s` is None when the hardware has no GPU)."""

    tokens: int
    flops: float
    bytes: float
    cpu_s: float
    gpu_s: float | None = None

    def on(self, device: "Device") -> float:
        s = self.gpu_s if device == Device.GPU else self.cpu_s
        if s is None:
            raise ValueError("no GPU time: the hardware profile has no GPU")
        return s

    def __str__(self) -> str:
        gpu = f" gpu {_si(self.gpu_s)}s" if self.gpu_s is not None else ""
        return f"{_si(self.flops)}FLOP {_si(self.bytes)}B cpu {_si(self.cpu_s)}s{gpu}"


#: stored weight formats other than the float dtype (WeightRef.fmt)
STORED_FORMATS = ("fp8",)
#: the block an FP8 weight held as stored is scaled in (both ways): what the GPU kernels read
FP8_BLOCK = 128


@dataclass(frozen=True)
class WeightRef:
    """A checkpoint tensor a node reads.

    `key` is the checkpoint name. When `experts` > 0 the key contains `{e}` and the reference
    stands for `experts` tensors of the same `shape`, one per expert (the weight loader also
    finds them in fused per-layer tensors; see ktflow.frontend.weights). `fmt` is how the checkpoint
    stores it: "" in the model's float dtype, or one of `STORED_FORMATS` ("fp8": e4m3 with
    block scales beside it, as FP8 releases store their linear layers). `held` is how the node
    holds it on its device, decided by placement: "" in the activation dtype (dequantized at
    load where stored otherwise), or "fp8": as stored, e4m3 bytes and FP8_BLOCK x FP8_BLOCK
    float32 scales, multiplied by the FP8 kernels (backends/fp8_gpu.py).
    """

    role: str
    key: str
    shape: tuple[int, ...]
    experts: int = 0
    fmt: str = ""
    held: str = ""

    def numel(self) -> int:
        n = max(self.experts, 1)
        for d in self.shape:
            n *= d
        return n

    def held_bytes(self, itemsize: int) -> float:
        """Bytes the node holds of it: `itemsize` per element, or held in FP8 one byte per
        element and a float32 scale per block."""
        if self.held == "fp8":
            r, c = self.shape
            blocks = -(-r // FP8_BLOCK) * -(-c // FP8_BLOCK)
            return max(self.experts, 1) * (r * c + 4 * blocks)
        return self.numel() * itemsize


def _si(x: float) -> str:
    """3 significant digits with an SI prefix: 1.5e9 -> '1.5G', 3.2e-6 -> '3.2u'."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    if x == 0 or abs(x) >= 1:
        return f"{x:.3g}"
    for unit, scale in (("m", 1e-3), ("u", 1e-6), ("n", 1e-9), ("p", 1e-12)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


#: the names a dtype option (CompileOptions.dtype, a config's torch_dtype) may take
DTYPE_BY_NAME = {"bfloat16": DType.BF16, "float16": DType.F16, "half": DType.F16, "float32": DType.F32,
                 "float": DType.F32}
