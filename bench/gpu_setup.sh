# Source on the GPU machine after `source .mlx-cuda-b/env.sh` (see ../shared/gpu/prepare-mlx-cuda):
# installs this checkout's packages, the mlx-lm wheel carried in .whl/ and NVIDIA's in .whl/nvidia/
# (nvidia-nvfatbin: `pip download nvidia-nvfatbin==13.5.37 --no-deps -d .whl/nvidia`; the machine
# has no package registry).
install_project
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
# NVIDIA's wheels (nvFatbin) beside the machine's own nvidia folder, which /tmp/site links to
if ls .whl/nvidia/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-nvidia .whl/nvidia/*.whl
  export PYTHONPATH=/tmp/site-nvidia:$PYTHONPATH
fi
python3 -c 'import mlx.core as mx, mlxrunner; print("mlx", mx.__version__, mx.default_device())'
