"""Makes the tests' helper modules importable and points at the conformance vectors."""

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CONFORMANCE = HERE.parent.parent / "conformance"
