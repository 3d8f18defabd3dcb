#!/usr/bin/env bash
# MLX's compiled CUDA kernels (the folder $1, MLX_PTX_CACHE_DIR) as $2/ptx-cache.txz.* (15 MB
# parts; the sources MLX writes beside them are left out): cat the parts into
# .gpu/ptx-cache.txz here and the next GPU machine starts with them. xz keeps it a third of
# gzip's size (3.6 MB for 246 kernels), so that it travels beside a 40 MB file; gzip where
# the machine has no xz.
cd "$1" || exit 0
if command -v xz >/dev/null; then
  tar cf - --exclude="*.cu" . | xz -T0 -6 > /tmp/ptx-cache.txz &&
    split -b 15m /tmp/ptx-cache.txz "$2/ptx-cache.txz."
else
  tar czf /tmp/ptx-cache.tgz --exclude="*.cu" . && split -b 15m /tmp/ptx-cache.tgz "$2/ptx-cache.tgz."
fi
