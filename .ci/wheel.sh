#!/usr/bin/env bash
# The published way to get ringlet: a manylinux abi3 wheel, built here, installed into a
# fresh venv with no Rust toolchain on PATH, where the README's main job must run.
#
# Tag: manylinux_2_28. The extension calls memfd_create (glibc 2.27) and statx (2.28), so no
# older tag is honest; torch's own wheels are manylinux_2_28 too. zig (PyPI's ziglang, via
# maturin[zig]) links against glibc 2.28 whatever this machine's glibc is; built natively on
# glibc 2.36 the wheel would be manylinux_2_34. maturin's own audit runs (no --auditwheel skip).
# (Don't lower the tag to manylinux2014: zig then links memfd_create unversioned, the audit
# cannot see it, and the wheel would fail on a real glibc 2.17.)
#
# Run from anywhere: bash .ci/wheel.sh (.ci/run does, after the main job). Everything but
# maturin[zig] lives in a temporary directory (cargo target, wheel, venv) removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
step=""
trap 'echo "wheel check FAILED at: $step (command: $BASH_COMMAND)" >&2' ERR
repo=$PWD
wheels="$repo/../shared/wheels"
t0=$SECONDS
say() { step=$1; echo "wheel check [$((SECONDS - t0))s]: $1"; }

# Into the running environment (as .ci/run's other installs), not a venv of its own: zig is
# 22,000 files, and deleting them again costs more than installing them.
say "install maturin and zig (pip install maturin[zig])"
python -m pip install -q "maturin[zig]>=1.5,<2"

say "build the manylinux_2_28 abi3 wheel with zig"
CARGO_TARGET_DIR="$tmp/target" \
  python -m maturin build --release --compatibility manylinux_2_28 --zig -o "$tmp/dist" 2>&1 \
  | grep -v '^ *Compiling '
whl=("$tmp"/dist/*.whl)
[[ ${#whl[@]} == 1 && ${whl[0]} == */ringlet-*-cp39-abi3-manylinux_2_28_x86_64.whl ]] \
  || { echo "expected one ...-cp39-abi3-manylinux_2_28_x86_64.whl, got: ${whl[*]}" >&2; false; }
echo "wheel check: $(basename "${whl[0]}"), $(du -k "${whl[0]}" | cut -f1) KiB"

say "fresh venv with torch, PATH without cargo or rustc"
python -m venv "$tmp/venv"
path="$tmp/venv/bin"
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do
  if [[ -n $d && ! -e $d/cargo && ! -e $d/rustc ]]; then path+=":$d"; fi
done
run() { env PATH="$path" "$@"; }
run bash -c '! command -v cargo && ! command -v rustc' >/dev/null \
  || { echo "a Rust toolchain is still on PATH" >&2; false; }
run pip install -q --find-links "$wheels" torch==2.13.0+cpu

say "install the wheel (binaries only, no Rust)"
run pip install -q --only-binary :all: "${whl[0]}"

say "run the main job from the installed wheel"
mkdir "$tmp/run"
(
  cd "$tmp/run"  # away from the checkout: `import ringlet` must find the venv's copy
  run python -c 'import ringlet, sys
assert ringlet.__file__.startswith(sys.prefix), ringlet.__file__'
  run torchrun --nproc_per_node 2 "$repo/examples/train_ddp.py"
)
say "passed"
