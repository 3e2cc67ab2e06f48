import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # `from helpers import ...` from tests/ and its subfolders, in any import mode
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "independent"))  # models written apart from models/


def capture_dynamo_graphs(fn, *args, **kwargs) -> list[torch.fx.GraphModule]:
    """The Dynamo FX graphs of `fn(*args)`, as a pass would see them (nothing is rewritten)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend)(*args, **kwargs)
    return graphs


@pytest.fixture
def dynamo_graphs():
    return capture_dynamo_graphs


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if has_cuda else 0
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2+ CUDA GPUs"))
