import functools

import pytest


@functools.lru_cache(maxsize=None)
def _has_compiler() -> bool:
    """Whether TVM's compiler imports here (the GPU machine's runtime-only payload has only the runtime)."""
    try:
        import tvmseq.build  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no compiler
        return False
    return True


def pytest_collection_modifyitems(config, items):
    from tvmseq.targets import has_gpu

    if has_gpu():
        no_compiler = pytest.mark.skip(reason="TVM's compiler is not installed here (runtime-only payload)")
        for item in items:
            if "compiles" in item.keywords and not _has_compiler():
                item.add_marker(no_compiler)
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU visible to TVM")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
