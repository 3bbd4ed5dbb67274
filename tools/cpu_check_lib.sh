# shellcheck shell=bash
# Shared by tools/check_cpu_kernels.sh and tools/check_cpu_attention.sh (sourced, not run): the
# torch-free CPU checks are built with the extension's CPU flags (CMakeLists.txt) and -Werror, one
# binary per -march target, and every failure is counted and shown.
#
#   cpu_check_init NAME DEFAULT_TARGETS... -- ARGS...   sets ROOT (cwd), CXX, TARGETS (ARGS, else
#                                                      the defaults), OUT (removed on exit),
#                                                      FAILURES
#   cpu_check_build TARGET SOURCE [FLAGS...]           builds $OUT/check_TARGET; prints and counts
#                                                      a failure (returns non-zero)
#   cpu_check_failed TARGET                            prints the end of $OUT/TARGET.log, counts it

# (TARGETS, OUT and FAILURES are read by the calling script.)
# shellcheck disable=SC2034
cpu_check_init() {
  local name="$1"
  shift
  local defaults=()
  while [[ $# -gt 0 && "$1" != -- ]]; do
    defaults+=("$1")
    shift
  done
  shift
  ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  cd "$ROOT" || exit 1
  CXX="${CXX:-g++}"
  if [[ $# -gt 0 ]]; then
    TARGETS=("$@")
  else
    TARGETS=("${defaults[@]}")
  fi
  OUT="$(mktemp -d "${TMPDIR:-/tmp}/$name.XXXXXX")"
  trap 'rm -rf "$OUT"' EXIT
  FAILURES=0
}

cpu_check_build() {
  local target="$1" source="$2"
  shift 2
  local arch=()
  [[ "$target" != default ]] && arch=("-march=$target")
  if ! "$CXX" -std=c++20 -O3 "${arch[@]}" -ffp-contract=off -fno-fast-math -fno-trapping-math \
      -Wall -Wextra -Werror -Wno-psabi "$@" -I csrc "$source" -o "$OUT/check_$target" \
      > "$OUT/$target.log" 2>&1; then
    echo "FAIL build for $target:"
    sed 's/^/    /' "$OUT/$target.log" | head -n 40
    FAILURES=$((FAILURES + 1))
    return 1
  fi
}

cpu_check_failed() {
  echo "FAIL $1:"
  sed 's/^/    /' "$OUT/$1.log" | tail -n 40
  FAILURES=$((FAILURES + 1))
}
