#!/usr/bin/env bash
# Every GPU check in one command on the lent GPU machine (benchmarks/GPU.md): installs the
# carried wheels and llmtrain (--no-deps: the image's torch and transformers stay), then runs
# benchmarks/gpu_run.py within GPU_RUN_BUDGET seconds (default 540, the install included),
# writing table.md, results.json, gpu_run.log and install.log under $OUT.
#
#   bash benchmarks/gpu_run.sh [--only NAME,...]     # on the GPU machine, wheels in .whl/
#   bash benchmarks/gpu_run.sh --smoke               # here, on the CPU: no install, tiny sizes
#   GPU_WHEELS=DIR bash benchmarks/gpu_run.sh --smoke  # the install from DIR too (a rehearsal)
#
# The wheels: `bash benchmarks/gpu_wheels.sh` here, then carry .whl (GPU.md has the call).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1

if [[ " $* " != *" --smoke "* || -n ${GPU_WHEELS:-} ]]; then
    wheels=${GPU_WHEELS:-.whl}
    if ! compgen -G "$wheels/*.whl" >/dev/null; then
        echo "gpu_run.sh: no wheels in $wheels: run 'bash benchmarks/gpu_wheels.sh' on a" \
            "machine with PyPI and carry $wheels (benchmarks/GPU.md)" >&2
        exit 2
    fi
    site=${GPU_SITE:-/tmp/llmtrain-site}
    {
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$wheels"/*.whl &&
            python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
                --upgrade --target "$site" .
    } >"$OUT/install.log" 2>&1
    status=$?
    # the checkout stays importable even if building llmtrain's wheel failed
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_run.sh: installed into $site in $((SECONDS - start)) s (status $status)"
    if ((status)); then
        tail -n 20 "$OUT/install.log"
        python3 -c "import pydantic, sqlalchemy, llmtrain" || exit 2
    fi
fi
budget=$((${GPU_RUN_BUDGET:-540} - (SECONDS - start)))
python3 benchmarks/gpu_run.py --out "$OUT" --budget "$budget" "$@"
