"""``TidalTrainer``: a ``transformers.Trainer`` whose optimizer, clipping and accumulation run inside tidal.

The user's loop does not change: ``TidalTrainer(model=…, args=TrainingArguments(…), tidal={…})``.

- The optimizer is built by the Trainer from ``TrainingArguments`` (``optim`` of the Adam/AdamW family,
  ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay`` with the Trainer's no-decay groups
  for biases and norms) and handed to :func:`tidal_stream.wrap`, which migrates it into an ``OffloadAdamW``.
- ``max_grad_norm`` is applied inside tidal (the global norm is reduced as gradients land on the host);
  the Trainer's own clipping is switched off (it would see no gradients: they left the device).
- ``gradient_accumulation_steps`` becomes tidal's accumulation (gradients sum on the host in fp32).
- The causal-LM loss is computed in chunks (:func:`tidal_hf.causal_lm_loss`): no full logits tensor.
- Log lines carry VRAM, pinned-memory and PCIe metrics; checkpoints carry the host optimizer state
  (``OffloadAdamW.state_dict`` includes the fp32 masters), so a resumed run continues bit-exactly.

[Note: micro-steps] ``OffloadAdamW`` counts one micro-step per ``step()`` call, but the Trainer calls
``step()`` once per accumulation window. ``training_step`` therefore advances the optimizer's micro-step
after every backward that is not the window's last, and before the last backward sets the window length
to the number of micro-batches actually seen (an epoch's final window may be shorter).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from tidal_hf.errors import UnsupportedModelError, bad_option
from tidal_hf.loss import causal_lm_loss, lm_head_of
from tidal_hf.structure import find_block_stack
from tidal_stream import OffloadAdamW, memory_report, wrap

__all__ = ["TidalTrainer", "wrap_hf"]

log = logging.getLogger(__name__)

_FROM_ARGS = {"max_grad_norm": "max_grad_norm", "accumulation_steps": "gradient_accumulation_steps"}
_GIB = 2**30


def wrap_hf(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **options: Any
) -> tuple[nn.Module, OffloadAdamW]:
    """:func:`tidal_stream.wrap` for a transformers (or PEFT) model, for custom training loops.

    The decoder-layer stack is found from the model's ``_no_split_modules`` and passed as ``blocks=``
    unless given. Everything else is ``wrap()``'s: the same options, the same returned pair.

    Args:
        model: a transformers model, possibly inside a PEFT wrapper.
        optimizer: a ``torch.optim.AdamW`` / ``Adam`` over its trainable parameters, or None (AdamW, ``lr=``).
        **options: any ``wrap()`` option (``vram_budget``, ``device``, ``max_grad_norm``, …).

    Returns:
        ``(model, optimizer)``.
    """
    if "blocks" not in options:
        stack = find_block_stack(model)
        if stack is not None:
            options["blocks"] = stack
    return wrap(model, optimizer, **options)


def _split_host_device(model: nn.Module) -> bool:
    """Whether the model's tensors lie partly in host memory and partly on a GPU."""
    kinds = {t.device.type for t in [*model.parameters(), *model.buffers()]}
    return {"cpu", "cuda"} <= kinds


class TidalTrainer(Trainer):
    """A ``transformers.Trainer`` that trains through tidal (see the module docstring).

    Args:
        *args: as ``transformers.Trainer``.
        tidal: options of :func:`tidal_stream.wrap` (``vram_budget``, ``offload``, ``moment_dtype``,
            ``param_offload``, ``activation_offload``, ``recompute``, ``device``, …). ``max_grad_norm`` and
            ``accumulation_steps`` come from ``TrainingArguments`` and are refused here.
        loss_chunk_size: tokens per logits chunk of the causal-LM loss; None computes the model's own loss
            (full logits). Default 1024.
        **kwargs: as ``transformers.Trainer``.

    Raises:
        OptionError: for ``fp16=True`` (loss scaling), a non-Adam ``optim``, or tidal options that belong
            in ``TrainingArguments``.
    """

    def __init__(
        self,
        *args: Any,
        tidal: Mapping[str, Any] | None = None,
        loss_chunk_size: int | None = 1024,
        **kwargs: Any,
    ) -> None:
        tidal = dict(tidal or {})
        for name, arg in _FROM_ARGS.items():
            if name in tidal:
                raise bad_option(
                    "TidalTrainer",
                    f"tidal[{name!r}]",
                    tidal[name],
                    f"no {name} here",
                    f"set TrainingArguments.{arg}",
                )
        if loss_chunk_size is not None and (
            not isinstance(loss_chunk_size, int) or isinstance(loss_chunk_size, bool) or loss_chunk_size <= 0
        ):
            raise bad_option("TidalTrainer", "loss_chunk_size", loss_chunk_size, "an int > 0, or None")
        targs = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
        if targs is not None and getattr(targs, "fp16", False):
            raise bad_option(
                "TidalTrainer",
                "TrainingArguments.fp16",
                True,
                "bf16=True or full precision",
                "fp16 needs loss scaling, which the host optimizer does not undo; use bf16=True "
                "(same memory, no scaler).",
            )
        if targs is not None:
            # clipping runs inside tidal: the Trainer's own clip would see no gradients (they left the device)
            clip = targs.max_grad_norm
            targs = copy.copy(targs)
            targs.max_grad_norm = 0.0
            if "args" in kwargs:
                kwargs["args"] = targs
            else:
                args = (args[0], targs, *args[2:])
        else:
            clip = 1.0  # TrainingArguments' default
        self._tidal_options = tidal
        self._tidal_clip = clip if clip and clip > 0 else None
        self._loss_chunk_size = loss_chunk_size
        self._tidal_micro = 0
        self._chunked_refused: str | None = (
            None  # why the chunked loss cannot serve this model ("" if it can)
        )
        self._tidal_last_log: tuple[float, int, int] | None = None
        super().__init__(*args, **kwargs)
        if self.args.n_gpu > 1:
            # without torchrun the Trainer would wrap the model in nn.DataParallel over every visible GPU:
            # replicas cannot share one streamed, host-updated model, so train on args.device alone
            log.warning(
                "TidalTrainer: %d GPUs visible in one process; training on %s only (launch with torchrun "
                "for data parallel)",
                self.args.n_gpu,
                self.args.device,
            )
            self.args._n_gpu = 1

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Leave a model split between host and device (``load_model(..., vram_budget=...)``) where it is.

        Its host blocks are the plan's streamed share: moving them would put the whole model on the device,
        the out-of-memory the budget exists to avoid. ``wrap()`` moves the resident rest to the device when
        the optimizer is created. A model wholly on one device moves as the Trainer moves it.
        """
        if torch.device(device).type == "cuda" and _split_host_device(model):
            log.info(
                "TidalTrainer: the model is split between host and device memory; left in place for wrap()"
            )
            return
        super()._move_model_to_device(model, device)

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self) -> torch.optim.Optimizer:
        """Build the Trainer's Adam/AdamW from ``TrainingArguments``, then move it into tidal."""
        if isinstance(self.optimizer, OffloadAdamW):
            return self.optimizer
        super().create_optimizer()
        built = self.optimizer
        if type(built) not in (torch.optim.AdamW, torch.optim.Adam):
            raise bad_option(
                "TidalTrainer",
                "TrainingArguments.optim",
                str(self.args.optim),
                "an optimizer of the Adam family built on torch.optim.AdamW/Adam ('adamw_torch', "
                f"'adamw_torch_fused'); it built {type(built).__name__}",
                "set optim='adamw_torch'",
            )
        options = dict(self._tidal_options)
        options["max_grad_norm"] = self._tidal_clip
        options["accumulation_steps"] = self.args.gradient_accumulation_steps
        if getattr(self.lr_scheduler, "optimizer", None) is built:
            raise bad_option(
                "TidalTrainer",
                "optimizers",
                f"({type(built).__name__}, {type(self.lr_scheduler).__name__})",
                "(optimizer, None) or no optimizers: the optimizer moves into tidal, and a scheduler built on the "
                "original would change learning rates nobody reads",
                "pass optimizers=(optimizer, None) and choose the schedule with TrainingArguments.lr_scheduler_type",
            )
        _, self.optimizer = wrap_hf(self.model, built, **options)
        log.info("TidalTrainer: optimizer %s moved into tidal", type(built).__name__)
        return self.optimizer

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # accelerate would copy the whole optimizer state to the device and back when preparing it; the
        # host state is tidal's to place. The Trainer itself moves the model and the inputs to the device.
        self.accelerator.device_placement = False

    @property
    def tidal_optimizer(self) -> OffloadAdamW | None:
        """The ``OffloadAdamW`` once training has started (None before)."""
        opt = self.optimizer
        opt = getattr(opt, "optimizer", opt)  # accelerate wraps it
        return opt if isinstance(opt, OffloadAdamW) else None

    # ------------------------------------------------------------------ steps
    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        opt = self.tidal_optimizer
        last = self.accelerator.gradient_state.sync_gradients
        if opt is not None:
            # see [Note: micro-steps]: the backward below lands gradients as micro-step _tidal_micro
            need = self._tidal_micro + 1 if last else self._tidal_micro + 2
            opt.accumulation_steps = need if last else max(need, self.args.gradient_accumulation_steps)
        loss = super().training_step(model, inputs, num_items_in_batch, **kwargs)
        if opt is not None:
            if last:
                self._tidal_micro = 0
            else:
                opt.step()  # a micro-step: gradients stay accumulated on the host, no update
                self._tidal_micro += 1
        return loss

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The chunked causal-LM loss when the batch has labels (see :func:`tidal_hf.causal_lm_loss`)."""
        if (
            self._loss_chunk_size is None
            or "labels" not in inputs
            or self.label_smoother is not None
            or self.compute_loss_func is not None
            or (return_outputs and not self.args.prediction_loss_only)
        ):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self._chunked_refused is None:
            try:
                lm_head_of(model)
                self._chunked_refused = ""
            except UnsupportedModelError as e:
                # not silent: logged once, and the reason kept on the trainer
                self._chunked_refused = str(e)
                log.warning("TidalTrainer: the model's own (full-logits) loss is used: %s", e)
        if self._chunked_refused:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        batch = dict(inputs)
        labels = batch.pop("labels")
        input_ids = batch.pop("input_ids")
        n_items = num_items_in_batch if self.model_accepts_loss_kwargs else None
        loss = causal_lm_loss(
            model, input_ids, labels, num_items_in_batch=n_items, chunk_size=self._loss_chunk_size, **batch
        )
        if self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs and n_items is not None:
            loss = loss * self.accelerator.num_processes
        if return_outputs:
            from transformers.modeling_outputs import CausalLMOutputWithPast

            return loss, CausalLMOutputWithPast(loss=loss)
        return loss

    # ------------------------------------------------------------------ logging
    def tidal_metrics(self) -> dict[str, float]:
        """VRAM, pinned host memory and PCIe traffic since the previous call (GB/s), for log lines."""
        opt = self.tidal_optimizer
        if opt is None:
            return {}
        rep = memory_report(self.model)
        out: dict[str, float] = {"tidal/pinned_gib": rep.get("pinned_bytes", 0) / _GIB}
        if "device_allocated_bytes" in rep:
            out["tidal/vram_gib"] = rep["device_allocated_bytes"] / _GIB
            out["tidal/vram_peak_gib"] = rep["device_peak_bytes"] / _GIB
        now, h2d, d2h = time.perf_counter(), rep.get("h2d_bytes", 0), rep.get("d2h_bytes", 0)
        if self._tidal_last_log is not None:
            t0, h0, d0 = self._tidal_last_log
            dt = max(now - t0, 1e-9)
            out["tidal/h2d_gbps"] = (h2d - h0) / dt / 1e9
            out["tidal/d2h_gbps"] = (d2h - d0) / dt / 1e9
        self._tidal_last_log = (now, h2d, d2h)
        if opt.last_grad_norm is not None:
            out["grad_norm"] = float(opt.last_grad_norm)
        return out

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs or "train_loss" in logs:
            logs = {**logs, **self.tidal_metrics()}
        super().log(logs, *args, **kwargs)
