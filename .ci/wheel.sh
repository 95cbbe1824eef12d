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
# The native torch.distributed Backend (C++, against libtorch's C++ ABI) is built first with
# this environment's torch (2.13.0 today) by the same code as the lazy build and put in
# python/ringlet/distributed/_prebuilt/<torch tag>/ (git-ignored; the wheel includes it, see
# pyproject.toml): a user with that torch needs no compiler. Its symbol versions are checked
# against manylinux_2_28 (glibc 2.28, GLIBCXX_3.4.25, CXXABI_1.3.11); maturin's audit looks
# at the Rust extension only. In the venv the compilers are off PATH too: the job must get
# the native Backend from the wheel, and a simulated other torch must say once why it cannot.
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

say "prebuild the native Backend for this environment's torch"
prebuilt="$repo/python/ringlet/distributed/_prebuilt"
rm -rf "$prebuilt"  # one torch per wheel: no library left from an earlier torch
# Into the checkout's package (maturin packs python/), whichever ringlet this Python imports
# (CI's first step installs a copy into site-packages: its sources are this checkout's).
so=$(python -c 'import sys; from pathlib import Path; from ringlet.distributed import _native
print(_native._prebuild(Path(sys.argv[1])))' "$prebuilt")
echo "wheel check: $so"
# Newest symbol version per library family must fit manylinux_2_28 (as the wheel's tag says)
newest() { objdump -T "$so" | grep -o "$1_[0-9.]*" | sort -uV | tail -1; }
for want in GLIBC_2.28 GLIBCXX_3.4.25 CXXABI_1.3.11; do
  have=$(newest "${want%%_*}")
  [[ -z $have || $(printf '%s\n%s\n' "$have" "$want" | sort -V | tail -1) == "$want" ]] \
    || { echo "the native library needs $have, newer than manylinux_2_28's $want" >&2; false; }
  echo "wheel check: native library needs ${have:-no ${want%%_*}} (manylinux_2_28 allows $want)"
done

say "build the manylinux_2_28 abi3 wheel with zig"
CARGO_TARGET_DIR="$tmp/target" \
  python -m maturin build --release --compatibility manylinux_2_28 --zig -o "$tmp/dist" 2>&1 \
  | grep -v '^ *Compiling '
whl=("$tmp"/dist/*.whl)
[[ ${#whl[@]} == 1 && ${whl[0]} == */ringlet-*-cp39-abi3-manylinux_2_28_x86_64.whl ]] \
  || { echo "expected one ...-cp39-abi3-manylinux_2_28_x86_64.whl, got: ${whl[*]}" >&2; false; }
echo "wheel check: $(basename "${whl[0]}"), $(du -k "${whl[0]}" | cut -f1) KiB"
inwheel="ringlet/distributed/_prebuilt/$(basename "$(dirname "$so")")/$(basename "$so")"
for f in "$inwheel" ringlet/distributed/csrc/backend.cpp ringlet/distributed/csrc/glibc_compat.cpp; do
  unzip -l "${whl[0]}" | grep -F " $f" || { echo "the wheel lacks $f" >&2; false; }
done

say "fresh venv with torch, PATH without a C/C++ compiler, cargo or rustc"
python -m venv "$tmp/venv"
# PATH: the venv, then one directory of links to everything on PATH but compilers and Rust
mkdir "$tmp/path"
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do
  [[ -n $d && -d $d && $d != "$tmp"/* ]] || continue
  for f in "$d"/*; do
    b=${f##*/}
    [[ -x $f && ! -e $tmp/path/$b ]] || continue
    [[ $b =~ ^(cargo|rustc|rustup|rustdoc|zig)$ ]] && continue
    [[ $b =~ (^|-)(cc|c\+\+|g\+\+|gcc|clang|clang\+\+|cpp)(-[0-9.]+)?$ ]] && continue
    ln -s "$f" "$tmp/path/$b"
  done
done
path="$tmp/venv/bin:$tmp/path"
run() { env PATH="$path" CXX=/nonexistent/c++ CC=/nonexistent/cc \
  TORCH_EXTENSIONS_DIR="$tmp/torch_extensions" "$@"; }
run bash -c '! command -v cargo && ! command -v rustc' >/dev/null \
  || { echo "a Rust toolchain is still on PATH" >&2; false; }
run bash -c '! command -v c++ && ! command -v g++ && ! command -v gcc && ! command -v cc' \
  >/dev/null || { echo "a C/C++ compiler is still on PATH" >&2; false; }
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

say "no compiler: init_process_group('ringlet') on the native Backend (mixed string, shrink)"
(
  cd "$tmp/run"
  run torchrun --nproc_per_node 2 "$repo/.ci/wheel_native_check.py" native
)

say "no compiler, a torch the wheel has no library for (simulated): the fallback says why"
(
  cd "$tmp/run"
  # CXX unset here: the failure is the one a user without a compiler meets (c++: not found)
  fb() { run env -u CXX -u CC python "$repo/.ci/wheel_native_check.py" fallback \
    "$tmp/torch_extensions" 2>/dev/null | tail -1; }
  first=$(fb)
  grep -q 'being built in a background process' <<<"$first" \
    || { echo "first fallback message: $first" >&2; false; }
  second=$(fb)  # the background build failed and is remembered: the compiler's own error
  grep -q 'failed earlier in this environment: /bin/sh: 1: c++: not found (full log: ' \
    <<<"$second" || { echo "second fallback message: $second" >&2; false; }
  echo "wheel check: ${second:0:260}..."
)
say "passed"
