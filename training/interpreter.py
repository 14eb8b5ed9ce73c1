"""The Python that runs tinychar's commands (train.py, sample.py, bench.py, python -m lab, data/bench.py): one too
old, or one without tinychar's requirements, said in one line.

tinychar needs Python 3.11 or newer (its modules import typing.Self, new in 3.11): on Python 3.10 the entry points
stopped in an ImportError traceback from inside the training package, or in a ModuleNotFoundError for requirements
never installed for that interpreter, neither saying that the Python was too old. This module reads only sys and os,
and runs on any Python that can parse the entry points (3.8 and later). On a recent enough Python, a requirement not
installed for it (torch in a fresh virtual environment) stopped them in a ModuleNotFoundError traceback too.
"""

from __future__ import annotations

import os
import sys

OLDEST = (3, 11)


def too_old(script: str, version_info: tuple = sys.version_info, executable: str = sys.executable) -> str | None:
    """The line that refuses to run script (its path as given) on the Python of version_info, or None when that
    Python is recent enough."""
    if tuple(version_info[:2]) >= OLDEST:
        return None
    running = ".".join(str(part) for part in version_info[:3])
    oldest = ".".join(str(part) for part in OLDEST)
    return (f"error: tinychar needs Python {oldest} or newer, and {executable or 'this Python'} is Python {running}; "
            f"run {os.path.basename(script)} with python{oldest} or newer, after "
            f"`python{oldest} -m pip install -r requirements.txt`")


def refuse_old_python(script: str) -> None:
    """Leave with the one-line refusal and status 2 when this Python is too old to run script."""
    line = too_old(script)
    if line is not None:
        print(line, file=sys.stderr)
        sys.exit(2)


# The requirements the entry points import, each under the name pip installs it by
REQUIREMENTS = {"torch": "torch", "yaml": "PyYAML", "numpy": "NumPy", "tqdm": "tqdm", "PIL": "Pillow",
                "tensorboard": "TensorBoard"}


def missing_requirement(error: ModuleNotFoundError, executable: str = sys.executable) -> str | None:
    """The line that says which requirement is not installed for this Python, when error is the import of one that
    found nothing; None for any other module (one of tinychar's own missing is a damaged clone, its traceback kept),
    or a requirement present but broken inside (torch._C)."""
    if error.name not in REQUIREMENTS:
        return None
    running = ".".join(str(part) for part in sys.version_info[:3])
    python = executable or "python"
    return (f"error: {REQUIREMENTS[error.name]} is not installed for {python} (Python {running}); install tinychar's "
            f"requirements for it with `{python} -m pip install -r requirements.txt`")
