"""pytest plugin for ``make test-verl``: runs verl's own unit tests (from its sdist) with
``dapo_kernels.integrations.verl.apply()`` in effect.

Loaded with ``-p verl_patch_plugin`` (PYTHONPATH=tests). The patch is applied before verl's test
modules are imported, so their ``from verl... import name`` gets the replacement. Every function
apply() installs is wrapped to count its calls; the summary prints the counts, and the session
fails if no call reached dapo_kernels (the tests would then have tested verl, not the patch).
"""
import collections
import inspect

import pytest

import dapo_kernels.integrations.verl as dkv

CALLS = collections.Counter()


def _counted(name, fn):
    def wrapper(*args, **kwargs):
        CALLS[name] += 1
        return fn(*args, **kwargs)
    wrapper.__name__, wrapper.__doc__, wrapper.__wrapped__ = fn.__name__, fn.__doc__, fn
    wrapper.__signature__ = inspect.signature(fn)
    return wrapper


def pytest_configure(config):
    for _, name, holder in dkv.PATCHES:  # what apply() installs, read from these holders at apply() time
        setattr(holder, name, _counted(name, getattr(holder, name)))
    dkv.apply()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_sep("=", "calls into dapo_kernels under integrations.verl.apply()")
    for name, n in sorted(CALLS.items()):
        terminalreporter.write_line(f"{name}: {n}")
    if not CALLS:
        terminalreporter.write_line("none: verl's tests did not reach the patched functions")


def pytest_sessionfinish(session, exitstatus):
    if not CALLS and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
