"""The GPT model: shared transformer body + per-vocabulary embeddings, as pipeline chunks."""
from .backends import Backends, BackendError, resolve_backends
from .embeddings import SourceEmbeddings, padded_vocab_size
from .gpt import (GPTStage, TransformerBlock, TransformerBody, activation_shape, build_model,
                  build_source_embeddings, chunk_layout, describe_backends)

__all__ = ["Backends", "BackendError", "resolve_backends", "SourceEmbeddings", "padded_vocab_size", "GPTStage",
           "TransformerBlock", "TransformerBody", "activation_shape", "build_model", "build_source_embeddings",
           "chunk_layout", "describe_backends"]
