"""gradwire: train language models on GPUs far apart on slow links.

A coordinator sends work orders to remote workers over gRPC; each worker computes a gradient, compresses it
(chunked DCT, top-k per chunk, 12-bit packed indices, 8-bit quantized values, error feedback) and sends the
payload back; the coordinator aggregates the payloads and takes the outer optimizer step.

Subpackages: ``gradwire.v1`` (generated protobuf/gRPC stubs), ``gradwire.compression`` (the codec),
``gradwire.models``, ``gradwire.worker``, ``gradwire.coordinator``.
"""

__version__ = "0.1.0"
