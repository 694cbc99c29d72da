"""Tiny checkpoints that carry a multi-token-prediction (MTP) layer, and the reference MTP.

A checkpoint with `num_hidden_layers` L and `num_nextn_predict_layers` 1 stores, beside the main
model, layer L as the published layout has it: a whole decoder layer (attention, router, experts,
shared experts, its two norms) under `model.layers.L.*`, plus `enorm`, `hnorm`, `eh_proj`
([hidden, 2 * hidden]) and `shared_head.norm`; DeepSeek-V3's releases also store `embed_tokens`
and `shared_head.head` there (copies of the main model's), and `own_embed_and_head=False` leaves
them out (the model's own then serve).

The reference is written from the published architecture with transformers' modules: the main
model gives the final normalised hidden state h_i of each position; the MTP input at position i
is eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]); a one-layer transformers model holding layer
L's weights runs it at positions 0..T-2 (its final norm is shared_head.norm, its head
shared_head.head), giving the logits of token i + 2.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from hf_tiny import CASES, _sharpen_routers


def make_mtp(case: str, directory: Path, seed: int = 0, own_embed_and_head: bool = True):
    """Save the `case` model with an MTP layer in `directory`; returns (main model, mtp) where mtp
    holds layer L's transformers module ("layer") and the MTP's own tensors by their checkpoint
    names ("enorm", "hnorm", "eh_proj", "shared_head.norm", and where stored "embed_tokens" and
    "shared_head.head")."""
    import transformers
    from safetensors.torch import load_file, save_file

    cls_name, kwargs = CASES[case]
    layers = kwargs["num_hidden_layers"]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_name)(**dict(kwargs, num_hidden_layers=layers + 1))
    cfg._attn_implementation = "eager"
    full = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _sharpen_routers(full, torch.Generator().manual_seed(seed + 1))
    full.eval()
    full.save_pretrained(directory)
    g = torch.Generator().manual_seed(seed + 2)
    h, v = cfg.hidden_size, cfg.vocab_size
    p = f"model.layers.{layers}"
    extra = {f"{p}.enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
             f"{p}.hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
             f"{p}.eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
             f"{p}.shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h, generator=g)}
    if own_embed_and_head:  # as DeepSeek-V3's releases: copies (here distinct, so a test sees which is read)
        extra[f"{p}.embed_tokens.weight"] = 0.1 * torch.randn(v, h, generator=g)
        extra[f"{p}.shared_head.head.weight"] = 0.1 * torch.randn(v, h, generator=g)
    files = sorted(directory.glob("*.safetensors"))
    assert len(files) == 1, files
    tensors = load_file(str(files[0]))
    tensors.update(extra)
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    raw = json.loads((directory / "config.json").read_text())
    raw.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    (directory / "config.json").write_text(json.dumps(raw, indent=1))
    mtp = {k[len(p) + 1:].removesuffix(".weight"): t for k, t in extra.items()}
    mtp["layer"] = full.model.layers[layers]
    main = _main_model(full, layers)
    return main, mtp


def _main_model(full, layers: int):
    """The first `layers` layers of `full` as their own model (the checkpoint's main model)."""
    main = copy.deepcopy(full)
    main.model.layers = main.model.layers[:layers]
    main.config.num_hidden_layers = layers
    return main


def mtp_logits(main, mtp: dict, ids: torch.Tensor) -> torch.Tensor:
    """The reference MTP logits [T - 1, vocab] of ids [T] (float32): row i predicts token i + 2
    from the main model's hidden state at i and token i + 1."""
    import transformers

    with torch.no_grad():
        out = main(ids.view(1, -1), output_hidden_states=True)
        hidden = out.hidden_states[-1][0]  # after the final norm
        cfg = copy.deepcopy(main.config)
        cfg.num_hidden_layers = 1
        if hasattr(cfg, "first_k_dense_replace"):
            cfg.first_k_dense_replace = 0  # the MTP layer is an MoE layer
        one = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        one.model.layers[0].load_state_dict(mtp["layer"].state_dict())
        one.model.norm.weight.copy_(mtp["shared_head.norm"])
        one.lm_head.weight.copy_(mtp.get("shared_head.head", main.lm_head.weight))
        embed = mtp.get("embed_tokens", main.model.embed_tokens.weight)
        eps = main.config.rms_norm_eps
        x = torch.cat([_rms(embed[ids[1:]], mtp["enorm"], eps), _rms(hidden[:-1], mtp["hnorm"], eps)], -1)
        x = x @ mtp["eh_proj"].T
        return one(inputs_embeds=x.view(1, *x.shape)).logits[0]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
