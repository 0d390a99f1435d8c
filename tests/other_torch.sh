#!/usr/bin/env bash
# Build virtualenvs with other torch releases, for tests/test_versions.py and the whole suite under each.
#
#     bash tests/other_torch.sh                          # torch 2.14.1 into .venvs/torch-2.14.1 (the repository's root)
#     bash tests/other_torch.sh 2.11.0 2.12.1 2.15.0     # several, each into .venvs/torch-VERSION
#     bash tests/other_torch.sh 2.14.1 /some/venv        # one version, a venv path
#
# Then:
#     python -m pytest -q -s tests/test_versions.py                   # finds every .venvs/torch-* by itself
#     CKPT_OTHER_PYTHONS=/a/bin/python:/b/bin/python python -m pytest -q -s tests/test_versions.py
#     PATH=.venvs/torch-2.14.1/bin:$PATH .venvs/torch-2.14.1/bin/python -m pytest -q test_resume.py tests
#
# Where torch comes from: first pip as configured on this machine (its local wheel folders, then PyPI); where that
# refuses the version (a local constraints file may cap torch), PyPI alone, with pip's configuration ignored
# (PIP_CONFIG_FILE=/dev/null). PyPI's Linux torch is the CUDA build: it needs its nvidia-* and cuda-* dependencies
# even to import on a machine without a GPU (libtorch.so links libcudnn, libcublas, libnccl, ...), so torch is
# installed with its dependencies (4.7 to 7 GB a venv), not with --no-deps: torch 2.15.0 with --no-deps and its
# pure-Python dependencies fails `import torch` with "libcudnn.so.9: cannot open shared object file".
# On this project's 2-core machine, busy with other jobs: 2.9.0 to 2.15.0 took 2.5 to 22 minutes each, 46 GB for
# eight; only 2.13.0 (the CPU build) and 2.14.1 lie on its disk, 2.15.0 is above its cap.
#
# A venv that already imports the asked torch is kept as it is (REBUILD=1 builds it again). Each venv is made by
# the python running this script (PYTHON, default python3): same minor version, so pip picks the same wheels.
# Each pip call is limited to 30 minutes. One line per version at the end: built, kept or failed, and seconds;
# the exit status is 1 if any failed (the others are still built).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
EXTRA=(safetensors pytest numpy torchdata==0.11.0)

if [[ $# -eq 2 && ! "$2" =~ ^[0-9]+\.[0-9]+ ]]; then
    VERSIONS=("$1"); VENVS=("$2")
else
    VERSIONS=("${@:-2.14.1}"); VENVS=()
    for v in "${VERSIONS[@]}"; do VENVS+=(".venvs/torch-$v"); done
fi

installed() {  # the torch release VENV imports, or nothing (nor if it lacks one of EXTRA)
    timeout 300 "$1/bin/python" -c "import safetensors, pytest, numpy, torchdata, torch; print(torch.__version__)" \
        2>/dev/null | tail -1
}

build() {  # VERSION VENV LOG: 0 if VENV imports torch VERSION with torch.distributed afterwards
    local version=$1 venv=$2 log=$3
    if [[ -n "${REBUILD:-}" ]]; then rm -rf "$venv"; fi
    "$PYTHON" -m venv "$venv" >>"$log" 2>&1 || return 1
    echo "== pip as configured: torch==$version" >>"$log"
    if ! timeout 1800 "$venv/bin/python" -m pip install -q "torch==$version" "${EXTRA[@]}" >>"$log" 2>&1; then
        echo "== PyPI alone, pip's configuration ignored: torch==$version" >>"$log"
        PIP_CONFIG_FILE=/dev/null PIP_CERT="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" \
            timeout 1800 "$venv/bin/python" -m pip install -q --no-cache-dir "torch==$version" "${EXTRA[@]}" \
            >>"$log" 2>&1 || return 1
    fi
    timeout 300 "$venv/bin/python" -c "import sys, torch, torch.distributed as d, torch.distributed.checkpoint
assert d.is_available(), 'torch.distributed is not available'
print(f'{sys.executable}: torch {torch.__version__}')" >>"$log" 2>&1 || return 1
    [[ "$(installed "$venv")" == "$version"* ]]
}

summary=() failed=0
for i in "${!VERSIONS[@]}"; do
    version=${VERSIONS[$i]} venv=${VENVS[$i]}
    mkdir -p "$(dirname "$venv")"
    log="$venv.log"
    start=$SECONDS
    if [[ -z "${REBUILD:-}" && "$(installed "$venv")" == "$version"* ]]; then
        result="kept"
    else
        : >"$log"
        if build "$version" "$venv" "$log"; then
            result="built"
        else
            result="FAILED (last lines of $log: $(tail -3 "$log" | tr '\n' ' ' | cut -c1-300))"
            failed=1
        fi
    fi
    line="torch $version: $result in $((SECONDS - start)) s, $venv ($(du -sh "$venv" 2>/dev/null | cut -f1))"
    echo "$line"
    summary+=("$line")
done
echo "---"
printf '%s\n' "${summary[@]}"
exit $failed
