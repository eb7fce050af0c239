#!/usr/bin/env bash
# Packs what a GPU host without a package registry needs beyond its own torch/CUDA image to run the
# cluster parts of l3pool (the tests, `l3pool demo`, bench/gpu-runs.sh): Mooncake's non-CUDA wheel
# for CPython 3.12 (it works beside a CUDA torch: the pool moves host memory), msgpack and pyzmq (the
# index), the etcd clients and the packages they need beyond grpcio/protobuf/requests, and, as Debian
# packages, etcd and the RDMA user-space libraries Mooncake links against. About 45 MB.
#
#   bash scripts/gpu-bundle.sh DIR     # on a machine with pip and apt: download into DIR
#                                      # (put DIR inside the checkout and git-ignore it: /gpu-bundle/ is)
#   source DIR/activate.sh             # on the GPU host: unpack once into a private prefix
#                                      # (GPU_BUNDLE_PREFIX, default /tmp/gpu-bundle) and export the paths
#
# Nothing is installed system-wide on either machine. PY (default 3.12) picks the host's Python.
set -euo pipefail
dir=${1:?usage: bash scripts/gpu-bundle.sh DIR}
py=${PY:-3.12}
mkdir -p "$dir"
wheels() {  # binary wheels for the GPU host's CPython, whatever this machine runs
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "$@"
}
wheels mooncake-transfer-engine-non-cuda==0.3.13.post1 msgpack pyzmq
# Mooncake's wheel without the two programs l3pool never runs (transfer_engine_bench, mooncake_client:
# about 15 MB of the 46 MB), so the bundle and a checkout fit a device call's 64 MiB
python3 - "$dir"/mooncake_transfer_engine_non_cuda-*.whl << 'SLIM'
import sys, zipfile, os
drop = ("mooncake/transfer_engine_bench", "mooncake/mooncake_client")
for path in sys.argv[1:]:
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename in drop:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(l for l in data.splitlines(True) if not l.split(b",")[0].decode() in drop)
            dst.writestr(info, data)
    os.replace(tmp, path)
SLIM
python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir" etcd3gw pbr futurist debtcollector aetcd
if ! ls /var/lib/apt/lists 2> /dev/null | grep -q Packages; then
  apt-get update -qq
fi
(cd "$dir" && apt-get download -qq etcd-server libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200)
cat > "$dir/activate.sh" << 'ACTIVATE'
# Sourced on the GPU host: unpacks the bundle beside it once, then exports PATH, PYTHONPATH and
# LD_LIBRARY_PATH for this shell.
_bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_prefix=${GPU_BUNDLE_PREFIX:-/tmp/gpu-bundle}
if [ ! -f "$_prefix/.unpacked" ]; then
  mkdir -p "$_prefix/root" "$_prefix/site"
  for _deb in "$_bundle"/*.deb; do dpkg -x "$_deb" "$_prefix/root"; done
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$_prefix/site" "$_bundle"/*.whl \
    && touch "$_prefix/.unpacked"
fi
export PYTHONPATH="$_prefix/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$_prefix/site/bin:$_prefix/root/usr/bin:$PATH"
export LD_LIBRARY_PATH="$_prefix/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ACTIVATE
du -sh "$dir"
