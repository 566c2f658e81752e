"""Pieces the Trainer examples share: a labelled token dataset and the Trainer settings they all use."""

from __future__ import annotations

from typing import Any

import torch

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LabeledIds(torch.utils.data.Dataset):
    """Rows of ``ids`` ``[n, seq_len]`` as causal-LM examples (labels = inputs)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids  # [n, seq_len]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def quantize_option(value: str) -> str | None:
    """``--quantize`` as ``load_model`` takes it: lower case, ``none`` meaning exact (None)."""
    return None if value.lower() == "none" else value.lower()


def tidal_options(vram_budget: str | None) -> dict[str, Any]:
    """TidalTrainer's ``tidal=`` options for ``--vram-budget`` (empty: tidal's defaults)."""
    return {"vram_budget": vram_budget} if vram_budget else {}


def training_args(
    output_dir: str, batch_size: int, steps: int, lr: float, logging_steps: int, **more: Any
) -> Any:
    """``TrainingArguments`` for a short example run: bf16 on CUDA, CPU otherwise, no saving or reports."""
    from transformers import TrainingArguments

    cuda = torch.cuda.is_available()
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size,
        max_steps=steps,
        learning_rate=lr,
        bf16=cuda,
        use_cpu=not cuda,
        logging_steps=logging_steps,
        save_strategy="no",
        report_to=[],
        optim="adamw_torch",
        disable_tqdm=True,
        **more,
    )
