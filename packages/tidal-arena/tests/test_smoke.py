import importlib


def test_imports_and_version():
    m = importlib.import_module("tidal_arena")
    assert m.__version__ == "0.1.0"
