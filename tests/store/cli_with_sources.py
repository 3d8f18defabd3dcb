"""``mlxrunner`` with model sources registered, for the store tests' subprocesses (a
plugin would register them; installing one is not what these tests check).

``MLXRUNNER_TEST_SOURCES``: JSON, name -> the fields of a :class:`mlxrunner.store.PackagedModel`.
"""

from __future__ import annotations

import json
import os
import sys
import types

import mlxrunner
from mlxrunner import host as plugins
from mlxrunner.cli import main
from mlxrunner.store import PackagedModel


def _register_models(register):
    for name, fields in json.loads(os.environ.get("MLXRUNNER_TEST_SOURCES", "{}")).items():
        register(name, PackagedModel(**fields))


if __name__ == "__main__":
    plugins.host().add_plugin(
        types.SimpleNamespace(register_models=mlxrunner.hookimpl(_register_models)),
        "store-test-sources")
    sys.exit(main(sys.argv[1:]))
