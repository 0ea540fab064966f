"""Install dept_mega. The custom ops in csrc/ are built when a compiler is present (see
dept_mega/ops/build.py); without them the pure PyTorch fallback is used."""
from setuptools import find_packages, setup

setup(
    name="dept_mega",
    version="0.1.0",
    description="Megatron-style trainer for DEPT (Decoupled Embeddings for Pre-Training)",
    packages=find_packages(include=["dept_mega", "dept_mega.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "numpy", "sentencepiece", "pyyaml"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "megatron-core"],
        "progress": ["tqdm"],
        "tensorboard": ["tensorboard"],
        "te": ["transformer-engine"],
        "flash": ["flash-attn"],
    },
)
