"""``python -m mlxrunner.cli``."""

import sys

from .main import main

sys.exit(main())
