"""User-facing errors.

Every failure a user can cause (bad flag, bad checkpoint, impossible mapping) is raised as a
`DFlashError` whose message is ONE line saying what failed, the values involved, and the fix.
The CLI prints it and exits non-zero; it never shows a traceback from inside a library.
"""

from __future__ import annotations

from typing import Callable


class DFlashError(Exception):
    """An error the user can fix. `str(err)` is a single actionable line."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # always one line


class InvalidRequest(DFlashError):
    """One request is invalid (bad sampling parameters, an empty or too long prompt, malformed
    chat messages). Servers answer it with INVALID_ARGUMENT (gRPC) / 400 (HTTP) and keep serving;
    it is the only exception type a request's validation raises, wherever it runs."""


def run_module_main(main: Callable[[], None]) -> None:
    """Run a ``python -m`` job's `main` with the CLI's contract: a DFlashError prints one line
    (``error: ...``) and exits with its code, never a traceback."""
    import sys

    try:
        main()
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
