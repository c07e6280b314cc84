#!/usr/bin/env bash
# Fetch the wheels that benchmarks/gpu_run.sh installs on the lent GPU machine, which reaches no
# registry and whose image lacks these packages (benchmarks/GPU.md has the list and sizes).
#
#   bash benchmarks/gpu_wheels.sh [all|base|trl] [DIR]      # default: all, into .whl/
#
# all: everything (one run, 54 MiB); base: llmtrain's needs, bitsandbytes and DeepSpeed (every
# check but TRL's side); trl: llmtrain's needs, TRL and datasets (the MFU checks). The wheels
# are for the image's CPython 3.12 on x86-64. DeepSpeed ships only an sdist: it is built here
# into a pure-Python wheel without compiled ops (DS_BUILD_OPS=0; its setup imports torch, so
# run this where torch is installed; the image has nvcc and ninja for ops built at run time).
set -euo pipefail
what=${1:-all}
dir=${2:-.whl}

LLMTRAIN=(
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
    sqlalchemy==2.1.9 pymongo==4.20.1 dnspython==2.9.2 sqlglot==30.31.0
)
QLORA_ZERO=(bitsandbytes==0.50.2 hjson==3.1.0)
TRL=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
DEEPSPEED=deepspeed==0.19.8

case $what in
all) pkgs=("${LLMTRAIN[@]}" "${QLORA_ZERO[@]}" "${TRL[@]}") ;;
base) pkgs=("${LLMTRAIN[@]}" "${QLORA_ZERO[@]}") ;;
trl) pkgs=("${LLMTRAIN[@]}" "${TRL[@]}") ;;
*) echo "usage: $0 [all|base|trl] [DIR]" >&2 && exit 2 ;;
esac
mkdir -p "$dir"

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# GPU_PYTHON: another image's CPython (3.11 fetches wheels a 3.11 machine can test them with)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
    --implementation cp "${platforms[@]}" -d "$dir" "${pkgs[@]}"

if [[ $what != trl ]] && ! compgen -G "$dir/deepspeed-*.whl" >/dev/null; then
    DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$DEEPSPEED"
fi
ls -l "$dir"
du -cb "$dir"/*.whl | tail -n 1
