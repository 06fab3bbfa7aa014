"""Whether a Python can import torch, asked before a command that needs it does anything.

`verify` runs the scripts with `--python` (this interpreter by default) and `convert` reads
checkpoints in this one; `rewrite` and `check` never need torch. The question is asked
without importing torch (`importlib.util.find_spec`), so it costs a fraction of a second.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Optional

_FIND = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torch') else 3)"


def missing_torch(command: str, python: str = sys.executable) -> Optional[str]:
    """None where `python` finds torch; else the one-line error `command` prints (exit 2)."""
    if python == sys.executable:
        import importlib.util

        found = importlib.util.find_spec("torch") is not None
    else:
        try:
            found = subprocess.run([python, "-c", _FIND], capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{command} cannot run {python}: {exc.strerror if isinstance(exc, OSError) else 'no answer in 60 s'}"
    return None if found else f"{command} needs torch in {python}: pip install torch"


def install_hint(python: str = sys.executable) -> str:
    """How to install torch into that very Python (the CPU wheel where there is no GPU)."""
    return (f"  {python} -m pip install torch  (CPU only: add --index-url https://download.pytorch.org/whl/cpu)")
