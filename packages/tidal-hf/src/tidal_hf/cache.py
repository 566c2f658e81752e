"""`TidalCache`: a transformers ``Cache`` over tidal-kv's `PagedKVCache`, for ``model.generate``.

Works with transformers 4.57 and 5.x: the per-layer objects implement both generations of the
``CacheLayerMixin`` API (``get_mask_sizes`` takes ``cache_position`` in 4.x and ``query_length`` in 5.x;
``get_max_cache_shape`` became ``get_max_length``). `generate_kwargs_for_cache` names the ``generate``
argument the installed transformers expects (``past_key_values`` up to early 5.x, ``cache`` after the rename).
transformers is imported by this module only, never at ``import tidal_hf`` time.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from tidal_hf.errors import OptionError, UnsupportedModelError, bad_option
from tidal_kv import PagedKVCache

_FULL = "full_attention"


def _text_config(model_or_config: Any) -> PretrainedConfig:
    """The decoder config of a model or config (multimodal configs keep it under ``text_config``)."""
    config = (
        model_or_config
        if isinstance(model_or_config, PretrainedConfig)
        else getattr(model_or_config, "config", None)
    )
    if not isinstance(config, PretrainedConfig):
        raise OptionError(
            f"model_or_config={type(model_or_config).__name__} is not accepted: expected a transformers "
            "PreTrainedModel or PretrainedConfig; pass the model you will call generate() on."
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"TidalCache serves decoder-only models; {config.model_type!r} is encoder-decoder. "
            "Use transformers' EncoderDecoderCache for it."
        )
    return config.get_text_config(decoder=True)


def _refuse_unsupported_layers(config: PretrainedConfig) -> None:
    """Raise for sliding-window, chunked or hybrid (non-attention) layers: a paged full cache would be wrong."""
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if window is not None else _FULL] * config.num_hidden_layers
    other = sorted({t for t in layer_types if t != _FULL})
    if other:
        raise UnsupportedModelError(
            f"TidalCache serves full-attention layers only; {config.model_type!r} has layer types {other} "
            f"(sliding_window={window}). Use transformers' DynamicCache(config=...) for this model."
        )
    if getattr(config, "num_kv_shared_layers", 0):
        raise UnsupportedModelError(
            f"TidalCache does not serve KV-sharing layers (num_kv_shared_layers="
            f"{config.num_kv_shared_layers}); use transformers' DynamicCache(config=...)."
        )


def _no_beams(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"TidalCache does not support {what} (beam search, contrastive or assisted decoding): the paged host "
        "pages cannot be reordered per step. Use greedy or sampling (num_beams=1), or DynamicCache."
    )


class _TidalLayer(CacheLayerMixin):
    """One layer's view of the shared :class:`~tidal_kv.PagedKVCache` (transformers' per-layer protocol)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, paged: PagedKVCache, index: int) -> None:
        # CacheLayerMixin.__init__ would assign keys/values, which are read-only views here
        self._paged = paged
        self._index = index

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self._paged.seq_length(self._index) > 0

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        """A copy of this layer's keys (legacy indexing; slow path)."""
        return self._paged.gather(self._index)[0] if self.is_initialized else None

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        """A copy of this layer's values (legacy indexing; slow path)."""
        return self._paged.gather(self._index)[1] if self.is_initialized else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        """Shapes are taken by the paged cache at the first update: nothing to do."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._paged.update(self._index, key_states, value_states)

    def get_mask_sizes(self, query: int | torch.Tensor) -> tuple[int, int]:
        """(kv_length, kv_offset); ``query`` is ``cache_position`` (4.x) or the query length (5.x)."""
        query_length = int(query.shape[0]) if isinstance(query, torch.Tensor) else int(query)
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._paged.seq_length(self._index)

    def get_max_cache_shape(self) -> int:  # transformers 4.x
        return -1

    def get_max_length(self) -> int:  # transformers 5.x
        return -1

    def reset(self) -> None:
        """Resetting goes through :meth:`TidalCache.reset` (all layers share one paged cache)."""

    def offload(self) -> None:
        """Placement is the paged cache's business: transformers' offloading hooks are no-ops here."""

    def prefetch(self) -> None:
        """See :meth:`offload`."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise _no_beams("reorder_cache")

    def crop(self, *args: Any, **kwargs: Any) -> None:
        raise _no_beams("crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1 and self.get_seq_length() > 0:
            raise _no_beams(f"batch_repeat_interleave({repeats})")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise _no_beams("batch_select_indices")


class TidalCache(Cache):
    """A transformers ``Cache`` whose offloaded layers keep their K/V in pinned host pages.

    Pass it as ``model.generate(..., **generate_kwargs_for_cache(model, cache))``, which is
    ``cache=cache`` on transformers 5.x releases that renamed the argument and ``past_key_values=cache``
    on 4.57 and earlier 5.x. Greedy and sampling
    work; beam search, contrastive and assisted decoding are refused, as are models with sliding-window,
    chunked, hybrid or KV-sharing layers.

    Args:
        model_or_config: The model (or its config) that will use the cache.
        max_tokens: Prompt + new tokens per sequence to preallocate for; longer sequences reallocate (logged).
        resident_layers: "auto", a count, or explicit layer indices kept in VRAM (see ``PagedKVCache``).
        page_tokens: Tokens per host page.
        vram_budget: Bytes of VRAM the cache may use for "auto" placement.
        storage: Host page format: "native" (exact), "fp8" or "nf4" (lossy; see ``tidal_kv.KVConfig.storage``).
        vram_fraction: Fraction of free VRAM for "auto" placement when ``vram_budget`` is None.
        prefetch_slots: Device gather slots (2 or 3).
        gather_stream: Where page gathers are issued: "auto" (default), "side" or "compute" (see
            ``tidal_kv.KVConfig.gather_stream``).

    Raises:
        UnsupportedModelError: the model cannot be served (the message says why and what to use instead).
        OptionError: ``model_or_config`` is neither a model nor a config.
        tidal_kv.KVConfigError: a bad cache option.
    """

    def __init__(
        self,
        model_or_config: Any,
        max_tokens: int,
        *,
        resident_layers: str | int | list[int] = "auto",
        page_tokens: int = 256,
        vram_budget: int | None = None,
        storage: str = "native",
        vram_fraction: float = 0.5,
        prefetch_slots: int = 2,
        gather_stream: str = "auto",
    ) -> None:
        config = _text_config(model_or_config)
        _refuse_unsupported_layers(config)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.paged = PagedKVCache(
            config.num_hidden_layers,
            max_tokens,
            num_kv_heads=heads,
            head_dim=head_dim,
            resident_layers=resident_layers,
            page_tokens=page_tokens,
            vram_budget=vram_budget,
            vram_fraction=vram_fraction,
            storage=storage,
            prefetch_slots=prefetch_slots,
            gather_stream=gather_stream,
        )
        super().__init__(layers=[_TidalLayer(self.paged, i) for i in range(config.num_hidden_layers)])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, H, T_new, D]`` K/V to ``layer_idx`` and return its full K/V (see ``PagedKVCache.update``)."""
        return self.paged.update(layer_idx, key_states, value_states)

    def reset(self) -> None:
        """Forget every cached token (buffers are kept)."""
        self.paged.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise _no_beams("reorder_cache")

    def crop(self, *args: Any, **kwargs: Any) -> None:
        raise _no_beams("crop")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise _no_beams("batch_select_indices")

    @property
    def stats(self) -> Any:
        """The paged cache's counters (``tidal_kv.KVStats``)."""
        return self.paged.stats

    def memory(self) -> dict[str, Any]:
        """The paged cache's placement and bytes (see ``PagedKVCache.memory``)."""
        return self.paged.memory()


def _cache_argument(fn: Any) -> str | None:
    """``"cache"`` or ``"past_key_values"``: the one of the two that ``fn``'s signature names, else None."""
    params = inspect.signature(fn).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


def generate_kwargs_for_cache(model: Any, cache: Cache) -> dict[str, Cache]:
    """The keyword argument that hands ``cache`` to ``model.generate()`` on the installed transformers.

    transformers 5.x renamed ``generate(past_key_values=...)`` to ``generate(cache=...)`` (the old name warns
    with a ``FutureWarning``); 4.57 knows only ``past_key_values``. ``generate()`` passes the cache to the
    model's ``prepare_inputs_for_generation`` under the name that method declares, so that signature (the
    base model's, under a PEFT wrapper; transformers' own when the model's takes only ``**kwargs``) decides.

    Args:
        model: The transformers model (PEFT-wrapped or not) whose ``generate`` will receive the cache.
        cache: A transformers ``Cache``: a :class:`TidalCache`, ``DynamicCache``, ...

    Returns:
        ``{"cache": cache}`` or ``{"past_key_values": cache}``: use as ``model.generate(ids, **kwargs)``.

    Raises:
        OptionError: ``cache`` is not a transformers ``Cache``, or ``model`` has no ``generate``.
    """
    from transformers.generation.utils import GenerationMixin

    fn = "generate_kwargs_for_cache"
    if not isinstance(cache, Cache):
        raise bad_option(
            fn, "cache", type(cache).__name__, "a transformers Cache", "pass TidalCache(model, n)."
        )
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not callable(getattr(base, "generate", None)):
        raise bad_option(
            fn,
            "model",
            type(model).__name__,
            "a transformers model with generate()",
            "pass the causal-LM model.",
        )
    prepare = getattr(base, "prepare_inputs_for_generation", GenerationMixin.prepare_inputs_for_generation)
    name = _cache_argument(prepare) or _cache_argument(GenerationMixin.prepare_inputs_for_generation)
    return {name or "past_key_values": cache}
