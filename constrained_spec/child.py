"""How the package starts a Python child of its own (the kernel-plan measurement, grammar
compiles) so that it imports only the installed package.

Python puts the working folder first on ``sys.path`` for ``-m``, so a ``constrained_spec/`` or
``torch.py`` left in the caller's folder would be imported and run as ours. A child therefore
runs in safe-path mode (``-P`` from Python 3.11, and ``PYTHONSAFEPATH=1`` in its environment on
every version: the flag for this interpreter, the variable for any Python the child itself
starts; Python 3.10 has neither, and there the caller's private empty working folder is what
keeps the caller's out), and with the ``PYTHONPATH`` entries that name the working folder
dropped (empty, ``.`` and every relative entry); absolute entries are the user's own choice (an
editable install's finder needs none) and are kept. The caller gives the child a neutral
working folder of its own.
"""

from __future__ import annotations

import os
import sys

__all__ = ["python_child"]


def python_child(*args: str) -> tuple[list[str], dict[str, str]]:
    """The command line (this interpreter, then ``args``) and environment of a child Python
    that imports only the installed package (see the module docstring)."""
    flags = ["-P"] if sys.version_info >= (3, 11) else []
    env = dict(os.environ)
    env["PYTHONSAFEPATH"] = "1"
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        env.pop("PYTHONPATH", None)
    return [sys.executable, *flags, *args], env
