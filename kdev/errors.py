"""Errors that carry kdev's exit codes (docs/architecture.md §5).

Stage modules raise these; kdev/cli turns them into one line on stderr and the exit code. Nothing else
in kdev calls sys.exit.
"""

import signal

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # a mismatch, a regression, a failed deploy gate
EXIT_BAD_INPUT = 2  # bad usage or bad input (config, vectors, arguments)
EXIT_NO_ENVIRONMENT = 3  # no GPU, no nvcc, library not built


class KdevError(Exception):
    exit_code = EXIT_BAD_INPUT


class BadInput(KdevError):
    exit_code = EXIT_BAD_INPUT


class CheckFailed(KdevError):
    exit_code = EXIT_CHECK_FAILED


class EnvironmentMissing(KdevError):
    exit_code = EXIT_NO_ENVIRONMENT


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the program is so that every `finally` runs: temp files and folders are removed
    and child compilers killed as for Ctrl-C (the default action would end the process on the spot)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum, self.signal_name = signum, signal.Signals(signum).name
