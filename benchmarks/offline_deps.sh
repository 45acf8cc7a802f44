#!/usr/bin/env bash
# The project's packages that a CUDA machine's image lacks (pylance, zstandard), as files to carry to a
# machine with no package index, for its Python (default 3.12): pylance's 85 MB wheel unpacked, with its
# library xz-compressed (48 MB: under a 64 MiB transfer), zstandard's wheel as is. The GPU figures of
# benchmarks/README.md ran this way (torch, numpy, pyarrow, numba, tqdm and tensorboard were the image's).
#   bash benchmarks/offline_deps.sh [FOLDER] [PYTHON_VERSION]       # here, with an index (default .whl, 3.12)
# then there, from the repository root:
#   mkdir -p /tmp/site && cp -r .whl/pylance/. /tmp/site/ \
#     && python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('/tmp/site/lance/lance.abi3.so.xz'), open('/tmp/site/lance/lance.abi3.so', 'wb'))" \
#     && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site bash benchmarks/gpu_session.sh
set -eu
out=${1:-.whl}; py=${2:-3.12}
versions=$(python -m app.pins)  # the pinned versions (`app/pins.py`), one `name==version` a line
pin() { echo "$versions" | grep -i "^$1==" ; }
mkdir -p "$out"; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
get() {
  python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "$2"
}
get "$out" "$(pin zstandard)"
get "$tmp" "$(pin pylance)"
rm -rf "$out/pylance"; mkdir -p "$out/pylance"
python -m zipfile -e "$tmp"/pylance-*.whl "$out/pylance"
xz -9 -T0 "$out/pylance/lance/lance.abi3.so"  # (-> lance.abi3.so.xz, the original removed)
du -sh "$out"
