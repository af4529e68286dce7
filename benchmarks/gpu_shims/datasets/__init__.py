"""A stand-in for Hugging Face `datasets` on the offline GPU machines, which lack it and its pyarrow and pandas (~70 MB
of wheels, more than one device call carries). tinker-cookbook's modules import `datasets` at module level; the
acceptance's tinker row (benchmarks/gpu_acceptance.py) puts this folder on the path only where `import datasets`
fails, so they import. Every name it gives is a placeholder that raises when called or when its attributes are read:
the arithmetic env and the SFT driver's in-memory dataset never use one, and a recipe that did would fail loudly
instead of training on something else. Users install `datasets`."""

__agentloop_standin__ = True


class _Refuses(type):
    def __getattr__(cls, attr: str):
        raise ImportError(f"datasets.{cls.__name__}.{attr}: {_WHY}")

    def __call__(cls, *args, **kwargs):
        raise ImportError(f"datasets.{cls.__name__}(): {_WHY}")


_WHY = "benchmarks/gpu_shims' stand-in for `datasets` (not installed on this machine); install datasets to use it"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Refuses(name, (), {})
