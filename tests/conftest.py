import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))


@pytest.fixture(autouse=True)
def _torch_threads():
    # Tests compare numbers, not speed; one intra-op thread keeps the emulated
    # workers from fighting over the 2 cores of CI.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
