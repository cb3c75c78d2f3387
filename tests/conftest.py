import pytest


def pytest_collection_modifyitems(config, items):
    from tvmseq.targets import has_gpu

    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU visible to TVM")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
