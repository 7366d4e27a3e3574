#!/bin/sh
# Guard for the rule of keel/core/cpu.h: AVX-512 code only inside functions of the AVX-512
# variants (names containing "avx512" in any case: their namespace, or lambdas and OpenMP bodies within
# them). Anything else must run on an AVX2-only CPU, so it must not touch an AVX-512 register:
# zmm, xmm16-31 / ymm16-31 (EVEX-only) or an opmask k0-k7. Also fails when no AVX-512 code is
# there at all (the variants went missing, or this check stopped seeing them).
#   avx512_only_in_avx512_functions.sh OBJDUMP LIBRARY_OR_OBJECT...
set -eu
objdump=$1
shift
"$objdump" -d --no-show-raw-insn -C "$@" | awk '
  /^[0-9a-f]+ <.*>:$/ { fn = $0; next }
  /%zmm|%[xy]mm(1[6-9]|2[0-9]|3[01])([^0-9]|$)|%k[0-7]([^0-9]|$)/ {
    if (tolower(fn) ~ /avx512/) { inside++ }
    else if (!(fn in seen)) { seen[fn] = 1; outside++; print "AVX-512 register outside an avx512 function: " fn }
  }
  END {
    if (outside > 0) exit 1
    if (inside == 0) { print "no AVX-512 instruction at all: the AVX-512 variants are missing"; exit 1 }
    print inside " AVX-512 instructions, all inside avx512 functions"
  }'
