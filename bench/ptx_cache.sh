#!/usr/bin/env bash
# MLX's compiled CUDA kernels between GPU machines (MLX_PTX_CACHE_DIR is the folder):
#   bash bench/ptx_cache.sh restore DIR       unpack .gpu/ptx-cache.txz (or .tgz) into DIR
#   bash bench/ptx_cache.sh save DIR OUT      DIR as OUT/ptx-cache.txz.* (15 MB parts; the
#                                             sources MLX writes beside them left out)
# Here, cat the parts into .gpu/ptx-cache.txz and the next machine starts with them. xz keeps
# it a third of gzip's size (3.6 MB for 246 kernels), so that it travels beside a 40 MB file;
# gzip where the machine has no xz. Python's tarfile unpacks either.
case "${1:-}" in
  restore)
    mkdir -p "$2"
    for f in .gpu/ptx-cache.txz .gpu/ptx-cache.tgz; do
      [ -f "$f" ] && python3 -c "import sys, tarfile
tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" "$f" "$2" && exit 0
    done
    exit 1 ;;
  save)
    cd "$2" || exit 0
    if command -v xz >/dev/null; then
      tar cf - --exclude="*.cu" . | xz -T0 -6 > /tmp/ptx-cache.txz &&
        split -b 15m /tmp/ptx-cache.txz "$3/ptx-cache.txz."
    else
      tar czf /tmp/ptx-cache.tgz --exclude="*.cu" . &&
        split -b 15m /tmp/ptx-cache.tgz "$3/ptx-cache.tgz."
    fi ;;
  *) echo "usage: bash bench/ptx_cache.sh restore DIR | save DIR OUT" >&2; exit 2 ;;
esac
