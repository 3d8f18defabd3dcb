"""mlxrunner-example-architecture: a small Llama-style architecture as an mlxrunner plugin.

The model lives in ``model.py``; ``plugin.py`` is the entry point that registers it.
Importing this package imports no MLX.
"""

__version__ = "0.1.0"
