"""Llama-family text models for mlxrunner (installed as the ``mlxrunner-llama`` plugin).

Importing this package imports no MLX; the model lives in ``mlxrunner_llama.model``.
"""

__version__ = "0.1.0"
