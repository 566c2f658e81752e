"""``TidalQuantizationConfig`` and its ``HfQuantizer``, registered with transformers under ``"tidal"``.

``AutoModelForCausalLM.from_pretrained(path, quantization_config=TidalQuantizationConfig("nf4"))`` gives
a model whose decoder-block ``nn.Linear`` layers are tidal ``QuantLinear`` (frozen; LoRA applies through
:func:`tidal_hf.lora_config`). Works with transformers 4.57 and 5.x: the quantizer leaves every weight to
transformers' own loader and converts the layers after loading (the hook both generations share).

[Note: memory] transformers reads the exact weights first, so this path peaks at the exact model size;
:func:`tidal_hf.load_model` quantizes while reading and peaks at the quantized size plus one tensor.
Models quantized this way are not saved quantized (``save_pretrained`` is refused by transformers);
save adapters, or the exact weights.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from tidal_hf.errors import UnsupportedModelError, bad_option
from tidal_hf.structure import find_block_stack
from tidal_quant import QuantLinear, quantize_model_

__all__ = ["METHOD", "TidalHfQuantizer", "TidalQuantizationConfig"]

log = logging.getLogger(__name__)

METHOD = "tidal"
_FORMATS = ("int8", "nf4", "fp8", "nvfp4")


class TidalQuantizationConfig(QuantizationConfigMixin):
    """Quantize a model's decoder-block linears to a tidal format while ``from_pretrained`` loads it.

    Args:
        fmt: ``"int8"``, ``"nf4"``, ``"fp8"`` or ``"nvfp4"``; default ``"nf4"``.
        block_size: block size of the format (None: its default, e.g. 64 for NF4).
        double_quant: quantize the NF4 block scales too (as bitsandbytes' double quantization).
        modules_to_not_convert: name fragments of layers to keep exact (e.g. ``["mlp.down_proj"]``).
        fp8_compute: int8 / nf4 / nvfp4: run the layers on FP8 tensor cores, the weight recast to e4m3 per
            call (``tidal_quant.QuantLinear``'s option of that name).
        fp8_backward: fp8: compute the input gradient on FP8 tensor cores too.
    """

    def __init__(
        self,
        fmt: str = "nf4",
        block_size: int | None = None,
        double_quant: bool = False,
        modules_to_not_convert: list[str] | None = None,
        fp8_compute: bool = False,
        fp8_backward: bool = False,
        **kwargs: Any,
    ) -> None:
        if fmt not in _FORMATS:
            raise bad_option("TidalQuantizationConfig", "fmt", fmt, f"one of {list(_FORMATS)}")
        if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool)):
            raise bad_option("TidalQuantizationConfig", "block_size", block_size, "an int, or None")
        for name, flag in (
            ("double_quant", double_quant),
            ("fp8_compute", fp8_compute),
            ("fp8_backward", fp8_backward),
        ):
            if not isinstance(flag, bool):
                raise bad_option("TidalQuantizationConfig", name, flag, "True or False")
        if fp8_compute and fmt == "fp8":
            raise bad_option(
                "TidalQuantizationConfig",
                "fp8_compute",
                fp8_compute,
                "False with fmt='fp8' (use fp8_backward)",
            )
        if fp8_backward and fmt != "fp8":
            raise bad_option(
                "TidalQuantizationConfig", "fp8_backward", fp8_backward, "False unless fmt='fp8'"
            )
        if modules_to_not_convert is not None and not (
            isinstance(modules_to_not_convert, (list, tuple))
            and all(isinstance(s, str) for s in modules_to_not_convert)
        ):
            raise bad_option(
                "TidalQuantizationConfig",
                "modules_to_not_convert",
                modules_to_not_convert,
                "a list of str, or None",
            )
        self.quant_method = METHOD
        self.fmt = fmt
        self.block_size = block_size
        self.double_quant = double_quant
        self.fp8_compute = fp8_compute
        self.fp8_backward = fp8_backward
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    def quantize_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``tidal_quant.quantize_model_`` besides the format."""
        out: dict[str, Any] = {}
        if self.block_size is not None:
            out["block_size"] = self.block_size
        for name in ("double_quant", "fp8_compute", "fp8_backward"):
            if getattr(self, name, False):  # configs saved before an option existed lack it
                out[name] = True
        return out


class TidalHfQuantizer(HfQuantizer):
    """The transformers side of :class:`TidalQuantizationConfig` (see the module docstring)."""

    requires_calibration = False
    requires_parameters_quantization = False
    required_packages = None

    def __init__(self, quantization_config: TidalQuantizationConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        if getattr(self, "pre_quantized", False):
            raise UnsupportedModelError(
                "this checkpoint says it was saved tidal-quantized (config.json has quantization_config with "
                "quant_method='tidal'); tidal does not save quantized weights. Fix: remove quantization_config "
                "from config.json and load the exact weights with quantization_config=TidalQuantizationConfig(...)."
            )

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to check: tidal-quant runs everywhere (pure-torch reference ops on the CPU)."""

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        return model

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        cfg: TidalQuantizationConfig = self.quantization_config
        stack = find_block_stack(model)
        if stack is None:
            raise UnsupportedModelError(
                f"TidalQuantizationConfig needs the decoder-layer stack, which {type(model).__name__} does not "
                "declare (_no_split_modules). Fix: load without it and call tidal_quant.quantize_model_."
            )
        prefix = next(n for n, m in model.named_modules() if m is stack) + "."
        skip = cfg.modules_to_not_convert

        def keep(name: str, _module: nn.Module) -> bool:
            return name.startswith(prefix) and not any(s in name for s in skip)

        quantize_model_(model, cfg.fmt, filter=keep, **cfg.quantize_kwargs())
        n = sum(isinstance(m, QuantLinear) for m in model.modules())
        log.info("TidalHfQuantizer: %d block linears stored as %s", n, cfg.fmt)
        return model

    def is_serializable(self, safe_serialization: Any = None) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        """Adapters (LoRA) train on top of the frozen quantized layers."""
        return True


def register() -> None:
    """Register the config and the quantizer with transformers (idempotent; done on import)."""
    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(METHOD)(TidalQuantizationConfig)
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(METHOD)(TidalHfQuantizer)


register()
