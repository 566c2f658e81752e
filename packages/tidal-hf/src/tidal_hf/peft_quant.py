"""LoRA on tidal ``QuantLinear`` layers through PEFT's custom-module mapping.

PEFT wraps only layer types it knows; ``LoraConfig._register_custom_module`` maps others to a LoRA layer
class. :class:`QuantLoraLinear` is PEFT's own ``lora.Linear`` over a ``QuantLinear`` base: the base runs
its quantized matmul (frozen, no weight gradient), the adapters add ``B(A(dropout(x))) * scaling`` exactly
as for an ``nn.Linear``. Merging is refused: a quantized base cannot absorb the update without rounding
it away. Use :func:`lora_config` (or :func:`enable_peft_quant` on a ``LoraConfig``) before
``get_peft_model``; saving and loading adapters is PEFT's, unchanged (``PeftModel.from_pretrained`` needs
``enable_peft_quant`` on the loaded config too: pass ``config=lora_config_from(path)``).
"""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig
from peft.tuners.lora.layer import Linear as LoraLinear

from tidal_hf.errors import UnsupportedModelError
from tidal_quant import QuantLinear

__all__ = ["QuantLoraLinear", "enable_peft_quant", "lora_config", "lora_config_from"]


class QuantLoraLinear(LoraLinear):
    """PEFT's LoRA ``Linear`` over a frozen tidal ``QuantLinear`` (created by PEFT's dispatcher)."""

    def _get_in_out_features(self, module: Any) -> tuple[int, int] | tuple[None, None]:
        if isinstance(module, QuantLinear):  # a type PEFT does not know: read its sizes directly
            return module.in_features, module.out_features
        return super()._get_in_out_features(module)

    def _get_base_layer_device_and_dtype(self, base_layer: Any) -> tuple[torch.device | None, None]:
        # the packed weight's device; no dtype: adapters keep their own (fp32 unless cast by the user)
        if isinstance(base_layer, QuantLinear):
            return base_layer.qweight.device, None
        return super()._get_base_layer_device_and_dtype(base_layer)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise UnsupportedModelError(
            "merging LoRA into a tidal QuantLinear is refused: the quantized weight would round the update away. "
            "Fix: keep the adapters separate, or load the exact base (quantize=None) and merge there."
        )

    def unmerge(self) -> None:
        return  # never merged (merge is refused)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """``B @ A * scaling`` ``[out, in]`` (as for an ``nn.Linear`` base)."""
        a = self.lora_A[adapter].weight  # [r, in]
        b = self.lora_B[adapter].weight  # [out, r]
        return (b @ a) * self.scaling[adapter]


def enable_peft_quant(config: LoraConfig) -> LoraConfig:
    """Let ``config`` wrap tidal ``QuantLinear`` layers (in place; returns it)."""
    if not isinstance(config, LoraConfig):
        raise UnsupportedModelError(
            f"enable_peft_quant: config={type(config).__name__} is not accepted; accepted: a peft.LoraConfig."
        )
    config._register_custom_module({QuantLinear: QuantLoraLinear})
    return config


def lora_config(**kwargs: Any) -> LoraConfig:
    """A ``peft.LoraConfig(**kwargs)`` that also wraps tidal ``QuantLinear`` layers.

    Example: ``lora_config(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")``.
    """
    return enable_peft_quant(LoraConfig(**kwargs))


def lora_config_from(path: str) -> LoraConfig:
    """The saved ``LoraConfig`` of an adapter folder, enabled for ``QuantLinear`` (for ``PeftModel.from_pretrained``)."""
    return enable_peft_quant(LoraConfig.from_pretrained(path))
