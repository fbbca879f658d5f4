"""The source tree beside these tests (TDIST_SOURCE_DIR where set) and its Python scripts loaded as
modules, for the tests of bench/ scripts."""

import importlib.util
import os

import pytest

REPO = os.environ.get("TDIST_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


def load_module(name: str, path: str):
    """The Python file at path, run as the module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_script(relative_path: str):
    """The repository's script relative_path as a module (named after the file); the calling test module
    is skipped, saying so, where the tree is not beside the tests."""
    path = os.path.join(REPO, relative_path)
    if not os.path.exists(path):
        pytest.skip(f"{relative_path} is not beside these tests", allow_module_level=True)
    return load_module(os.path.splitext(os.path.basename(path))[0], path)
