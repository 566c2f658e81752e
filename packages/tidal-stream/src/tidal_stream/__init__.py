"""tidal-stream: train models whose optimizer state, gradients, weights or activations exceed the GPU.

``wrap(model, optimizer)`` keeps the training loop unchanged while fp32 master weights, Adam moments and
gradients live in pinned host memory, updated by the host as backward runs.
"""

from tidal_stream.__about__ import __version__
from tidal_stream.activations import ActivationHandle, install_activation_policy
from tidal_stream.distributed import DistributedConfig, DistributedError
from tidal_stream.errors import NotWrappedError, OptionError, StateDictError, StreamError
from tidal_stream.losses import LossError, chunked_cross_entropy, dpo_loss, sequence_logprobs
from tidal_stream.optimizer import OffloadAdamW
from tidal_stream.options import WrapOptions
from tidal_stream.session import Session
from tidal_stream.sharded_optimizer import ShardedHostAdamW
from tidal_stream.streamed_blocks import ResidencyEvent, SlotBudgetError, StreamedBlocks, StreamingError
from tidal_stream.streams import (
    DeviceStreams,
    device_streams,
    record_event,
    stream_context,
    wait_stream,
)
from tidal_stream.weights import WeightStreamingHandle, install_weight_streaming
from tidal_stream.wrap import memory_report, session_of, unwrap, wrap

__all__ = [
    "ActivationHandle",
    "DeviceStreams",
    "DistributedConfig",
    "DistributedError",
    "LossError",
    "NotWrappedError",
    "OffloadAdamW",
    "OptionError",
    "ResidencyEvent",
    "Session",
    "ShardedHostAdamW",
    "SlotBudgetError",
    "StateDictError",
    "StreamError",
    "StreamedBlocks",
    "StreamingError",
    "WeightStreamingHandle",
    "WrapOptions",
    "__version__",
    "chunked_cross_entropy",
    "device_streams",
    "dpo_loss",
    "install_activation_policy",
    "install_weight_streaming",
    "memory_report",
    "record_event",
    "sequence_logprobs",
    "session_of",
    "stream_context",
    "unwrap",
    "wait_stream",
    "wrap",
]
