"""gpt-oss's MXFP4 experts, as the published checkpoints hold them, dequantized to the training
dtype during the sharded load, each rank only its own experts; and quantized back, for an
export in the base model's layout.

The format (OCP Microscaling, as transformers' ``integrations/mxfp4.py`` reads it): each expert
weight ``W`` is stored transposed, ``[experts, out, in]``, cut along ``in`` into blocks of 32
values. ``<name>_blocks`` (uint8 ``[experts, out, in / 32, 16]``) packs each block's 32 FP4
(E2M1) values two to a byte, the even position in the low nibble; ``<name>_scales`` (uint8
``[experts, out, in / 32]``) is each block's shared power of two, biased by 127. A value is
``FP4[nibble] * 2 ** (scale - 127)``. The model's parameter (``gate_up_proj``: ``[experts, in,
out]``) is the dequantized ``W`` transposed back.

    plans = mxfp4_plans(missing_names, checkpoint_keys)
    read = fill_mxfp4({name: param for name in plans}, plans, directory)
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.model.errors import ModelError

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per shared scale
SCALE_BIAS = 127
BLOCKS, SCALES = "_blocks", "_scales"


class Mxfp4Error(ModelError):
    """The checkpoint's MXFP4 tensors do not fit the model's parameter; the message says which."""


def is_mxfp4(config: object) -> bool:
    """Whether a transformers config (or config.json's dict) names MXFP4-quantized weights."""
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if quantization is None:
        quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return False
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    return str(getattr(method, "value", method)) == "mxfp4"


def mxfp4_plans(missing: list[str], available: set[str]) -> list[str]:
    """The parameters among ``missing`` (names the safetensors lack) that the files hold as
    ``<name>_blocks`` and ``<name>_scales``."""
    return [name for name in missing if name + BLOCKS in available and name + SCALES in available]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[experts, out, in / 32, 16]`` blocks and ``[experts, out, in / 32]`` scales as the
    model's ``[experts, in, out]`` weight in ``dtype`` (computed in float32, exact: every FP4
    value times a power of two is a float32)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] * 2 != BLOCK:
        raise Mxfp4Error(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.int64)
    values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1).flatten(-2)  # [.., groups, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1))
    weight = values.flatten(-2)  # [experts, out, in]
    return weight.transpose(-1, -2).contiguous().to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's ``[experts, in, out]`` weight as (blocks, scales), rounding each value to the
    nearest FP4 value of its block's scale (the largest magnitude of a block lands within
    [4, 8) times its power of two, so it is kept to 1 part in 8 and nothing overflows)."""
    transposed = weight.detach().float().transpose(-1, -2)  # [experts, out, in]
    if transposed.shape[-1] % BLOCK:
        raise Mxfp4Error(f"MXFP4 needs the input dimension to be a multiple of {BLOCK}, not {transposed.shape[-1]}")
    groups = transposed.reshape(*transposed.shape[:-1], -1, BLOCK)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 2, torch.zeros_like(amax))
    exponent = exponent.clamp(-SCALE_BIAS, 255 - SCALE_BIAS)
    scaled = torch.ldexp(groups, -exponent.to(torch.int32).unsqueeze(-1))
    magnitudes = torch.tensor(FP4_VALUES[:8])
    nearest = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # ties to the smaller value
    codes = nearest + 8 * (scaled < 0).to(torch.int64) * (nearest > 0).to(torch.int64)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8).contiguous()


def fill_mxfp4(tensors: dict[str, torch.Tensor], names: list[str], directory: Path) -> int:
    """Copy into each ``tensors[name]`` (a parameter, whole or sharded on its experts) the
    dequantized rows of this rank's experts, read from ``directory``'s safetensors one expert
    at a time. Returns the checkpoint tensors read."""
    from safetensors import safe_open

    from trainer.model.merged_experts import checkpoint_files, copy_expert, local_rows

    where = checkpoint_files(directory)
    read = 0
    for name in names:
        local, first, count = local_rows(tensors[name])
        with (
            safe_open(where[name + BLOCKS], framework="pt") as blocks,
            safe_open(where[name + SCALES], framework="pt") as scales,
        ):
            block_slice, scale_slice = blocks.get_slice(name + BLOCKS), scales.get_slice(name + SCALES)
            for row in range(count):
                expert = first + row
                weight = dequantize(block_slice[expert : expert + 1], scale_slice[expert : expert + 1], local.dtype)[0]
                copy_expert(local, row, weight, f"{name}: expert {expert} of the checkpoint, dequantized,")
                read += 2
    return read
