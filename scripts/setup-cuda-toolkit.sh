#!/usr/bin/env bash
# Builds a CUDA 13.0 "CUDA_ROOT" from PyPI wheels + a generated libcuda.so link stub,
# on a machine with no GPU and no CUDA install. Idempotent. Usage:
#   bash scripts/setup-cuda-toolkit.sh [ROOT=~/.cache/cuda13-pip]   -> writes $ROOT/env.sh
# Needs: python3 (venv), gcc, cargo (to fetch and locate cudarc's sources).
set -euo pipefail
ROOT=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/cuda13-pip}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$ROOT"
cd "$ROOT"

# 1. CUDA 13.0.x pieces from PyPI (13.0 = driver 580; nvrtc/nvcc must not be newer than the driver)
[ -x venv/bin/pip ] || python3 -m venv venv
venv/bin/pip install -q --no-cache-dir \
  "nvidia-cuda-nvcc==13.0.88" "nvidia-cuda-crt==13.0.88" "nvidia-nvvm==13.0.88" \
  "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" \
  "nvidia-cublas==13.0.2.14" "nvidia-curand==10.4.0.35" "nvidia-cuda-nvrtc==13.0.88" \
  "nvidia-nccl-cu13>=2.28"
P=$(venv/bin/python -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')/nvidia/cu13

# 2. CUDA_ROOT-like folder by symlinks (nvcc resolves its own TOP from the real bin/ path)
R=$ROOT/cuda
rm -rf "$R"; mkdir -p "$R/lib64/stubs"
ln -s "$P/bin" "$R/bin"; ln -s "$P/include" "$R/include"; ln -s "$P/nvvm" "$R/nvvm"
for f in "$P"/lib/*.so* "$P"/lib/*.a; do ln -s "$f" "$R/lib64/"; done
( cd "$R/lib64"
  for n in cudart cublas cublasLt nvrtc; do ln -s lib$n.so.13 lib$n.so; done
  ln -s libcurand.so.10 libcurand.so
  # NCCL (the `nccl` feature links it; the GPU machine has its own libnccl.so.2)
  ln -s "$P/../nccl/lib/libnccl.so.2" libnccl.so.2; ln -s libnccl.so.2 libnccl.so )
ln -s lib64 "$R/lib"

# 3. libcuda.so link stub (no PyPI/Debian-main package ships one): every cu* entry point that
#    cudarc 0.19.10 binds, as a dummy, SONAME libcuda.so.1. Only used at link time; the real
#    driver's libcuda.so.1 is loaded on the GPU machine.
cudarc_src() { ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.* 2>/dev/null | sort -V | tail -1 || true; }
CUDARC_SRC=$(cudarc_src)
# A fresh machine has no crate sources yet: fetch this workspace's (candle with cuda brings cudarc).
[ -n "$CUDARC_SRC" ] || { (cd "$REPO" && cargo fetch -q) && CUDARC_SRC=$(cudarc_src); }
[ -n "$CUDARC_SRC" ] || { echo "cudarc sources not found after \`cargo fetch\` in $REPO" >&2; exit 1; }
grep -oh "fn cu[A-Za-z0-9_]*" "$CUDARC_SRC/src/driver/sys/mod.rs" | sed 's/^fn //' | sort -u \
  | awk '{print "int " $1 "(void){return 999;}"}' > "$ROOT/libcuda_stub.c"
gcc -shared -fPIC -o "$R/lib64/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$ROOT/libcuda_stub.c"

cat > "$ROOT/env.sh" <<EOF
export CUDA_ROOT=$R
export CUDA_HOME=\$CUDA_ROOT
export PATH=\$CUDA_ROOT/bin:\$PATH
export CUDA_COMPUTE_CAP=90
export CUDARC_CUDA_VERSION=13000
export CUDAFORGE_THREADS=2
export RUSTFLAGS='-C link-arg=-Wl,-rpath,\$ORIGIN:\$ORIGIN/lib:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib'
EOF
. "$ROOT/env.sh"
nvcc --version | tail -2
echo "OK: source $ROOT/env.sh, then cargo build --release"
