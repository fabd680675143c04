"""ds_pipe_ckpt: activation checkpointing for DeepSpeed pipeline parallelism on
torch's non-reentrant checkpoint."""

import os

from setuptools import find_packages, setup


def ops_extension():
    """The optional pack/unpack ops (csrc/), built when DS_PIPE_CKPT_BUILD_OPS=1, as
    DeepSpeed's DS_BUILD_* variables do. Needs torch importable at build time
    (``pip install --no-build-isolation``) and nvcc. Without it the ops are built
    just in time on first use on a CUDA machine (ds_pipe_ckpt.placement.kernels), or the
    pure-torch fallback is used."""
    if os.environ.get("DS_PIPE_CKPT_BUILD_OPS", "0") != "1":
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    extension = CUDAExtension(
        name="ds_pipe_ckpt.placement._ops",  # a library of torch ops (TORCH_LIBRARY), loaded with torch.ops.load_library
        sources=["csrc/ops.cpp", "csrc/batched_copy.cu"],
        define_macros=[("DS_PIPE_CKPT_WITH_CUDA", None)],
        extra_compile_args={"cxx": ["-O2"], "nvcc": ["-O3"]},
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(
    name="ds_pipe_ckpt",
    version="0.2.0",
    description="Activation checkpointing for DeepSpeed pipeline-parallel training, "
    "built on torch's non-reentrant checkpoint",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["ds_pipe_ckpt", "ds_pipe_ckpt.*"]),
    # The range `make compat` runs the unit tests against (README.md, "Supported
    # versions"; ds_pipe_ckpt.compat.TORCH_RANGE and DEEPSPEED_RANGE say the same).
    install_requires=[
        "torch>=2.11,<2.16",
        "deepspeed>=0.16.9,<0.20",
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
            # Drop-in tests drive real transformers models (built from configs, nothing downloaded).
            "transformers>=5,<6",
            # LoRA fine-tuning under a memory budget (tests/llama/test_llama_lora.py).
            "peft",
        ],
        "example": ["torchvision", "matplotlib", "tqdm"],
    },
    **ops_extension(),
)
