"""tidal-hf: Hugging Face integration of tidal.

``load_model`` (meta init, tensor-by-tensor safetensors reading, quantize while reading), ``TidalTrainer``
(a ``transformers.Trainer`` whose optimizer, clipping and accumulation run inside tidal), ``wrap_hf``,
``TidalQuantizationConfig`` for ``from_pretrained(quantization_config=…)``, LoRA on ``QuantLinear``,
chunked causal-LM losses, one-model DPO, and ``TidalCache`` for ``generate`` (``generate_kwargs_for_cache``
names the argument the installed transformers expects). transformers and peft are imported only when a name that
needs them is first used, so ``import tidal_hf`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from tidal_hf.__about__ import __version__
from tidal_hf.errors import CheckpointError, OptionError, TidalHFError, UnsupportedModelError

__all__ = [
    "CheckpointError",
    "OptionError",
    "StepTimeCallback",
    "TidalCache",
    "TidalHFError",
    "TidalQuantizationConfig",
    "TidalTrainer",
    "UnsupportedModelError",
    "__version__",
    "causal_lm_logprobs",
    "causal_lm_loss",
    "dpo_loss",
    "enable_peft_quant",
    "generate_kwargs_for_cache",
    "load_model",
    "lora_config",
    "lora_config_from",
    "qwen25_config",
    "reference_logprobs",
    "tiny_config",
    "wrap_hf",
]

# public name -> module that defines it (imported on first use: several import transformers or peft)
_LAZY = {
    "StepTimeCallback": "tidal_hf.callbacks",
    "TidalCache": "tidal_hf.cache",
    "TidalQuantizationConfig": "tidal_hf.quantizer",
    "TidalTrainer": "tidal_hf.trainer",
    "causal_lm_logprobs": "tidal_hf.loss",
    "causal_lm_loss": "tidal_hf.loss",
    "dpo_loss": "tidal_hf.dpo",
    "enable_peft_quant": "tidal_hf.peft_quant",
    "generate_kwargs_for_cache": "tidal_hf.cache",
    "load_model": "tidal_hf.loading",
    "lora_config": "tidal_hf.peft_quant",
    "lora_config_from": "tidal_hf.peft_quant",
    "qwen25_config": "tidal_hf.shapes",
    "reference_logprobs": "tidal_hf.dpo",
    "tiny_config": "tidal_hf.shapes",
    "wrap_hf": "tidal_hf.trainer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal_hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
