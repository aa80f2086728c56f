#!/bin/sh
# bench/ab_gemm_vnni/run.sh BASE_TREE M N K CALLS ARM...: builds BASE_TREE's and this tree's gemm_vnni.cpp into one
# binary (ab_gemm_vnni.cpp says how it compares them) and runs it. Needs g++ and an AVX-512 VNNI CPU.
set -e
base=$1; shift
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${TMPDIR:-/tmp}/ab_gemm_vnni.$$
mkdir -p "$out"
isa="-std=c++17 -O3 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mfma -mf16c -ffp-contract=off -Wno-maybe-uninitialized -Wno-uninitialized"
inc="-I$here/native/src -I$here/native/src/kernels"
sed 's/void gemm_vnni(/void gemm_vnni_base(/' "$base/native/src/kernels/gemm_vnni.cpp" > "$out/base.cpp"
# The base copy leaves out its peak loop (-DSG_KERNEL_EMULATION guards only that there), so the symbol is this tree's.
g++ $isa $inc -DSG_KERNEL_EMULATION -c "$out/base.cpp" -o "$out/base.o"
g++ $isa $inc -c "$here/native/src/kernels/gemm_vnni.cpp" -o "$out/new.o"
g++ -std=c++17 -O2 $inc -c "$here/native/src/threadpool.cpp" -o "$out/threadpool.o"
g++ -std=c++17 -O2 $inc -c "$here/bench/ab_gemm_vnni/ab_gemm_vnni.cpp" -o "$out/main.o"
g++ -o "$out/ab" "$out/main.o" "$out/base.o" "$out/new.o" "$out/threadpool.o" -lpthread
"$out/ab" "$@"
rm -rf "$out"
