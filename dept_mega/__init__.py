"""dept_mega: a Megatron-style trainer implementing DEPT (Decoupled Embeddings for Pre-Training)."""
__version__ = "0.1.0"
