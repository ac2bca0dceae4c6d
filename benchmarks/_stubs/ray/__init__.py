"""Import-only stand-in for ray, so verl's modules import in the benchmark env.

Only module-level names verl touches at import time exist; calling any of them raises.
"""


def _unavailable(*args, **kwargs):
    raise RuntimeError("ray is stubbed out in the dapo-kernels benchmark environment")


def remote(*args, **kwargs):
    if args and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


init = get = put = wait = kill = shutdown = _unavailable


def is_initialized():
    return False


def __getattr__(name):
    import types

    mod = types.ModuleType(f"ray.{name}")
    mod.__getattr__ = lambda n: _unavailable  # type: ignore[attr-defined]
    return mod
