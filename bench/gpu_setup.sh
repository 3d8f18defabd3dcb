# Source on the GPU machine after `source .mlx-cuda-b/env.sh` (see ../shared/gpu/prepare-mlx-cuda):
# installs this checkout's packages and the mlx-lm wheel carried in .whl/ (the machine has no
# package registry).
install_project
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
python3 -c 'import mlx.core as mx, mlxrunner; print("mlx", mx.__version__, mx.default_device())'
