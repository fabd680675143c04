#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with what the GPU machine lacks to run DeepSpeed:
# a wheel of DeepSpeed itself (an sdist on PyPI, built here without its ops)
# and the cp312 wheels of the requirements its image does not have. Run it
# here, with network access, before the GPU call; it ends by checking that the
# set is complete against the GPU machine's packages (tests/gpu/wheels.py).
#
#     bash tests/gpu/prepare_wheels.sh          # then, on the GPU machine:
#     run(command="bash tests/gpu/run.sh", carry=[".whl"], timeout_s=540)
#
# Pins: one version of each. DeepSpeed 0.19.8 needs hjson and pydantic>=2 beyond
# what the image holds; pydantic 2.14 needs typing-extensions>=4.16, which is
# carried too because the image's version is not known (the carried one comes
# first on PYTHONPATH there).
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS="${WHEELS:-.whl}"
BUILD_PYTHON="${BUILD_PYTHON:-.venv/bin/python}"   # has torch and setuptools: DeepSpeed's setup.py imports torch
DEEPSPEED=deepspeed==0.19.8
DEPENDENCIES=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
              typing-inspection==0.4.5 typing-extensions==4.16.0)

mkdir -p "$WHEELS"
if ! ls "$WHEELS"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
    # DS_BUILD_OPS=0: a pure-Python wheel; ops are built just in time where needed
    # (the checks use none: torch's Adam, no fused kernels).
    DS_BUILD_OPS=0 "$BUILD_PYTHON" -m pip wheel -q --no-deps --no-build-isolation "$DEEPSPEED" -w "$WHEELS"
fi
"$BUILD_PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" "${DEPENDENCIES[@]}"
du -sh "$WHEELS"
"$BUILD_PYTHON" tests/gpu/wheels.py "$WHEELS"
