#!/usr/bin/env bash
# The device machine has torch, triton and transformers but not the server's other dependencies, and it cannot
# reach PyPI. `bash bench/device_wheels.sh download` (here) fills .whl/ (git-ignored; carry it: `carry: [".whl"]`)
# with wheels for CPython 3.10-3.13 on x86_64 Linux; `bash bench/device_wheels.sh install` (on the device, which
# bench/run_h200.sh does when .whl/ is there) installs the ones that fit its Python into /tmp/site.
set -eu
PKGS="fastapi starlette uvicorn h11 click pydantic pydantic_core annotated_types typing_inspection typing_extensions
prometheus_client nvidia-ml-py anyio sniffio httpx httpcore idna certifi annotated-doc opentelemetry-api
importlib-metadata zipp xgrammar apache-tvm-ffi"
case "${1:-install}" in
  download)
    mkdir -p .whl
    for v in 3.10 3.11 3.12 3.13; do
      pip download -q --only-binary=:all: --no-deps --python-version "$v" --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d .whl $PKGS
    done ;;
  install)
    python3 -c "import fastapi, pydantic, xgrammar" 2>/dev/null && exit 0
    PYTHONPATH=/tmp/site python3 -c "import fastapi, pydantic, xgrammar" 2>/dev/null && exit 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links .whl --target /tmp/site $PKGS ;;
esac
