"""gradwire's gradient codec: chunked DCT-II, per-chunk top-k, 12-bit indices, bit-packed LUT or sign values.

Pure tensor -> payload -> tensor code: no networking and no knowledge of models beyond tensor names and
shapes. ``GradientCodec`` is the entry point; ``serde`` converts payloads to and from the proto messages.
"""

from gradwire.compression.aggregate import Aggregator
from gradwire.compression.codec import DecodedGradient, GradientCodec
from gradwire.compression.config import FORMAT_VERSION, CodecConfig
from gradwire.compression.feedback import ErrorFeedback
from gradwire.compression.payload import (
    CompressedGradient,
    CompressedTensor,
    Encoding,
    NonFiniteInput,
    PayloadError,
    ValueFormat,
)
from gradwire.compression.plan import ChunkGroup, ModelPlan, TensorPlan

__all__ = [
    "FORMAT_VERSION",
    "Aggregator",
    "ChunkGroup",
    "CodecConfig",
    "CompressedGradient",
    "CompressedTensor",
    "DecodedGradient",
    "Encoding",
    "ErrorFeedback",
    "GradientCodec",
    "ModelPlan",
    "NonFiniteInput",
    "PayloadError",
    "TensorPlan",
    "ValueFormat",
]
