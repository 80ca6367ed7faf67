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


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group on loopback for the duration of the test."""
    import torch.distributed as dist
    from train_util import free_port
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
