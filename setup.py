"""ds_pipe_ckpt: activation checkpointing for DeepSpeed pipeline parallelism on
torch's non-reentrant checkpoint."""

from setuptools import find_packages, setup

setup(
    name="ds_pipe_ckpt",
    version="0.1.0",
    description="Activation checkpointing for DeepSpeed pipeline-parallel training, "
    "built on torch's non-reentrant checkpoint",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["ds_pipe_ckpt", "ds_pipe_ckpt.*"]),
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19.8,<0.20",
        "numpy",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-timeout",
            "hypothesis>=6",
            "torchvision",
            "matplotlib",
            "tqdm",
        ],
        "example": ["torchvision", "matplotlib", "tqdm"],
    },
)
