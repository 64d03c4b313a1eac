"""The scripts' shared epilogue: how a script reports a user error (one line on stderr, exit 2).

Kept apart from utils/cli.py so that a light script (plot_runs) need not import the config stack.

    try:
        ...
    except (EqtrainError, OSError) as e:
        return script_error(e, where=args.out, hint="check --out")
"""

from __future__ import annotations

import sys

from utils.errors import EqtrainError


def script_error(e: EqtrainError | OSError, where: object = None, hint: str = "") -> int:
    """Print `e` as one `error: ...` line on stderr and return 2, the scripts' exit code for a user
    error. An OSError (a file the script writes) names its file, else `where`, and ends with `hint`."""
    if isinstance(e, EqtrainError):
        print(f"error: {e}", file=sys.stderr)
    else:
        line = f"error: cannot write {e.filename or where}: {e.strerror or e}"
        print(f"{line}: {hint}" if hint else line, file=sys.stderr)
    return 2
