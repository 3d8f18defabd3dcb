"""``mlxrunner`` with model sources registered, for the store tests' subprocesses (a
plugin would register them; installing one is not what these tests check), and a place to
stop at for the tests that kill it.

``MLXRUNNER_TEST_SOURCES``: JSON, name -> the fields of a :class:`mlxrunner.store.PackagedModel`.
``MLXRUNNER_TEST_PAUSE``: JSON ``{"after": "save_safetensors" | "replace", "match": TEXT,
"signal": PATH}``: after the first ``mx.save_safetensors(path, ...)`` whose path (or
``os.replace(src, dst)`` whose destination) contains TEXT, write PATH and wait to be killed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

import mlx.core as mx

import mlxrunner
import mlxrunner.plugin
from mlxrunner import host as plugins
from mlxrunner.cli import main
from mlxrunner.store import PackagedModel


def _register_models(register):
    for name, fields in json.loads(os.environ.get("MLXRUNNER_TEST_SOURCES", "{}")).items():
        register(name, PackagedModel(**fields))


def _pause_after(module, name: str, match: str, signal: Path) -> None:
    real = getattr(module, name)

    def paused(*args, **kwargs):
        result = real(*args, **kwargs)
        path = str(args[1] if name == "replace" else args[0])
        if match in path:
            signal.write_text(path)
            time.sleep(600)  # the test kills the process here
        return result

    setattr(module, name, paused)


if __name__ == "__main__":
    pause = os.environ.get("MLXRUNNER_TEST_PAUSE")
    if pause:
        spec = json.loads(pause)
        _pause_after(os if spec["after"] == "replace" else mx, spec["after"], spec["match"],
                     Path(spec["signal"]))
    plugins.host().add_plugin(
        types.SimpleNamespace(register_models=mlxrunner.plugin.hookimpl(_register_models)),
        "store-test-sources")
    sys.exit(main(sys.argv[1:]))
