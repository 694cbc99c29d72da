"""Quantized checkpoints: config.json's `quantization_config`, and block-scaled FP8 weights.

ktflow reads the FP8 layout DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8 and GLM-4.5-FP8 are published
in: `quant_method: "fp8"`, `fmt: "e4m3"`, `weight_block_size: [bo, bi]` (128 x 128 as
published), dynamic activations. A quantized linear's weight [out, in] is stored as F8_E4M3
beside `<name>.weight_scale_inv`, float32 [ceil(out / bo), ceil(in / bi)]: the real weight is
w8[i, j] * scale_inv[i // bo, j // bi]. Every other tensor (norms, routers, correction biases,
embeddings, lm_head, and the release's `modules_to_not_convert`) keeps its float dtype; which
is which is read from each tensor's dtype in the safetensors header.

`QuantConfig.parse` validates the config; `dequantize` turns one stored tensor into float32,
one tensor at a time (a routed expert's three matrices while it is packed), so no float copy of
the whole model is ever held. Other methods (AWQ, GPTQ, compressed-tensors, bitsandbytes,
MXFP4, ...) are refused with the method named.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import ConfigError

#: quant_method -> what ktflow reads of it
READS = {"fp8": "block-scaled e4m3 weights with weight_scale_inv (DeepSeek-V3 style)"}
SCALE_SUFFIX = "_scale_inv"  # "<linear>.weight" -> "<linear>.weight_scale_inv"
FP8_DTYPES = ("F8_E4M3",)  # safetensors dtype names of FP8 weights


@dataclass(frozen=True)
class QuantConfig:
    method: str
    fmt: str
    block: tuple[int, int]

    @staticmethod
    def parse(raw: Any, where: str) -> "QuantConfig | None":
        """The checkpoint's quantization, or None for a float checkpoint."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: quantization_config must be an object, not {type(raw).__name__}")
        method = raw.get("quant_method")
        if method not in READS:
            reads = "; ".join(f"{k}: {v}" for k, v in READS.items())
            raise ConfigError(f"{where}: quantization_config.quant_method {method!r} is not read by ktflow (it reads "
                              f"{reads}); use the bf16 or FP8 release of this model")
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"{where}: quantization_config.fmt {fmt!r} is not supported (e4m3)")
        block = raw.get("weight_block_size")
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ConfigError(f"{where}: quantization_config.weight_block_size {block!r} must be two positive "
                              "integers (128, 128 as published); per-tensor or per-channel FP8 is not supported")
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ConfigError(f"{where}: quantization_config.activation_scheme {scheme!r} is not supported (dynamic)")
        return QuantConfig(method, fmt, (block[0], block[1]))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        bo, bi = self.block
        return (-(-shape[0] // bo), -(-shape[1] // bi))


@dataclass(frozen=True)
class Fp8Matrix:
    """A block-scaled FP8 matrix as a checkpoint stores it, or a part of one: `data` [n, k] e4m3,
    `scale_inv` the whole tensor's block scales ([ceil(N / bn), ceil(K / bk)] for the [N, K]
    tensor) and (row0, col0) where `data` starts in that tensor. Packed without a float copy."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    row0: int = 0
    col0: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def rows(self, lo: int, hi: int) -> "Fp8Matrix":
        return replace(self, data=self.data[lo:hi], row0=self.row0 + lo)

    def cols(self, lo: int, hi: int) -> "Fp8Matrix":
        return replace(self, data=self.data[:, lo:hi].contiguous(), col0=self.col0 + lo)

    def scale_arg(self) -> tuple[int, int, int, int]:
        """(address, row stride, row0, col0) of the scales, as the native packer takes them."""
        return (self.scale_inv.data_ptr(), self.scale_inv.stride(0), self.row0, self.col0)


def stored_fp8(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an FP8 release stores tensor `name` in e4m3: the linear layers' weights; norms,
    routers, correction biases, embeddings and the output head stay float (as DeepSeek-V3's and
    Qwen3's FP8 releases do). For writing test and benchmark checkpoints in that layout."""
    keep = ("norm", "embed_tokens", "lm_head", "mlp.gate.weight", "e_score_correction_bias")
    return name.endswith(".weight") and len(shape) == 2 and not any(k in name for k in keep)


def config_entry(block: tuple[int, int] = (128, 128)) -> dict:
    """config.json's quantization_config of an FP8 release with `block` scales."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def scale_key(key: str) -> str:
    return key + SCALE_SUFFIX


def dequantize(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w8 [out, in] (float8) times its block scales [ceil(out/bo), ceil(in/bi)] -> float32."""
    bo, bi = block
    out, inn = w8.shape
    w = w8.float()
    if out % bo == 0 and inn % bi == 0:  # whole blocks: the scales broadcast over a blocked view
        w.view(out // bo, bo, inn // bi, bi).mul_(scale_inv.float()[:, None, :, None])
        return w
    return w.mul_(scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inn])


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (e4m3 [out, in], float32 scale_inv [ceil(out/bo), ceil(in/bi)]) as FP8
    releases store it: per block, scale = amax / 448 and w8 = nearest e4m3 of w / scale (so
    `dequantize(*quantize(w, block), block)` is w to e4m3's 3-bit mantissa)."""
    bo, bi = block
    out, inn = w.shape
    rows, cols = -(-out // bo), -(-inn // bi)
    padded = torch.zeros(rows * bo, cols * bi)
    padded[:out, :inn] = w.float()
    amax = padded.view(rows, bo, cols, bi).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / 448.0).float()
    full = scale.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inn]
    return (w.float() / full).to(torch.float8_e4m3fn), scale


def check_pair(key: str, dtype: str, shape: tuple[int, ...], scale: tuple[str, tuple[int, ...]] | None,
               quant: QuantConfig | None) -> str | None:
    """Why an FP8 tensor `key` cannot be read (None if it can): the checkpoint must declare FP8
    and hold its scales, of the block grid's shape, in a float dtype."""
    if quant is None:
        return (f"tensor {key!r} is {dtype} but config.json has no quantization_config (an FP8 checkpoint "
                "declares quant_method 'fp8' and its weight_block_size)")
    if len(shape) != 2:
        return f"tensor {key!r} is {dtype} with shape {list(shape)}; FP8 weights are matrices"
    if scale is None:
        return f"FP8 tensor {key!r} has no {scale_key(key)!r} beside it"
    sdtype, sshape = scale
    want = quant.scale_shape(shape)
    if sdtype not in ("F32", "BF16", "F16"):
        return f"tensor {scale_key(key)!r} has dtype {sdtype}; block scales are float"
    if tuple(sshape) != want:
        return (f"tensor {scale_key(key)!r} has shape {list(sshape)}, expected {list(want)} (the {list(shape)} "
                f"weight in {quant.block[0]}x{quant.block[1]} blocks)")
    return None
