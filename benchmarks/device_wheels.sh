#!/usr/bin/env bash
# Builds .whl/, the Python 3.12 wheels benchmarks/device_session.sh installs on the lent GPU machine (its image has
# torch and CUDA but not these; nothing outside it can be reached from it), at the tested set's versions
# (constraints.txt), for x86_64 Linux. bitsandbytes keeps its CPU and CUDA 13.0 libraries alone (the machine's CUDA;
# the whole wheel is over 100 MB, more than a call may carry). Run here, from the repository root, before the call:
#     bash benchmarks/device_wheels.sh && du -sh .whl
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES="trl datasets dill multiprocess fsspec pydantic pydantic_core annotated-types typing-inspection
typing_extensions regex accelerate bitsandbytes transformers tokenizers peft"
CUDA_LIBRARY=cuda130
pinned() {  # the package as constraints.txt pins it (names compared as pip normalises them)
    awk -F'==' -v want="$1" 'function norm(n) { n = tolower(n); gsub(/[_.]/, "-", n); return n }
        !/^#/ && norm($1) == norm(want) { print; exit }' constraints.txt
}
folder=$(mktemp -d)
trap 'rm -rf "$folder"' EXIT
for package in $PACKAGES; do
    spec=$(pinned "$package")
    [ -n "$spec" ] || { echo "constraints.txt pins no $package" >&2; exit 1; }
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$folder" "$spec"
done
python3 - "$folder" "$CUDA_LIBRARY" <<'PY'
import pathlib, sys, zipfile

folder, cuda = pathlib.Path(sys.argv[1]), sys.argv[2]
for wheel in folder.glob("bitsandbytes-*.whl"):
    kept = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(kept, "w", zipfile.ZIP_DEFLATED) as target:
        def wanted(name: str) -> bool:
            library = name.rsplit("/", 1)[-1]
            return not library.startswith("libbitsandbytes_") or library.startswith(
                ("libbitsandbytes_cpu", f"libbitsandbytes_{cuda}."))
        for item in source.infolist():
            if not wanted(item.filename):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):  # the libraries left out leave the record too
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if wanted(line.split(",", 1)[0])).encode()
            target.writestr(item, data)
    kept.replace(wheel)
PY
rm -rf .whl.new && mkdir .whl.new && mv "$folder"/*.whl .whl.new/ && rm -rf .whl && mv .whl.new .whl
ls .whl
