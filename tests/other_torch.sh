#!/usr/bin/env bash
# Build a second virtualenv with another torch release, for tests/test_versions.py and the whole suite under it.
#
#     bash tests/other_torch.sh                      # torch 2.14.1 into .venvs/torch-2.14.1 (the repository's root)
#     bash tests/other_torch.sh 2.14.1 /some/venv    # a version, a venv path
#
# Then:
#     python -m pytest -q -s tests/test_versions.py                   # finds .venvs/torch-2.14.1 by itself
#     CKPT_OTHER_PYTHON=/some/venv/bin/python python -m pytest -q -s tests/test_versions.py
#     PATH=.venvs/torch-2.14.1/bin:$PATH .venvs/torch-2.14.1/bin/python -m pytest -q test_resume.py tests
#
# The venv is made by the python running this script (PYTHON, default python3): same minor version, so pip
# picks the same wheels. Each pip call is limited to 30 minutes (torch's CUDA wheels are large).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-2.14.1}"
VENV="${2:-.venvs/torch-$VERSION}"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m venv "$VENV"
timeout 1800 "$VENV/bin/python" -m pip install -q "torch==$VERSION" safetensors pytest numpy torchdata==0.11.0
"$VENV/bin/python" -c "import sys, torch; print(f'{sys.executable}: torch {torch.__version__}')"
