#!/usr/bin/env bash
# What a device call would send: the working tree (tracked and untracked-not-ignored files)
# and the paths named in carry, against the device's 64 MiB a call. Run it before a call
# that carries large paths (a refused call still costs the warm machine's 30 s window).
#   bash bench/carry_size.sh .mlx-cuda-b .whl .gguf-a
# paths are the repository's (where the device call starts)
cd "$(dirname "$0")/.." && git rev-parse --git-dir >/dev/null || exit 2
for path in "$@"; do
  [ -e "$path" ] || { echo "carry_size.sh: $path: not found (paths are the repository's)" >&2
                      exit 2; }
done
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null |
       tail -1 | cut -f1)
carried=0
for path in "$@"; do
  size=$(du -sb "$path" | cut -f1)
  printf '%-24s %6.1f MB\n' "$path" "$(echo "${size:-0} / 1000000" | bc -l)"
  carried=$((carried + ${size:-0}))
done
total=$((tree + carried))
printf '%-24s %6.1f MB\n%-24s %6.1f MB of %.1f MB (64 MiB)\n' "working tree" \
  "$(echo "$tree / 1000000" | bc -l)" "total" "$(echo "$total / 1000000" | bc -l)" \
  "$(echo "64 * 1048576 / 1000000" | bc -l)"
[ "$total" -le $((64 * 1048576)) ]
