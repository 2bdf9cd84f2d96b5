import os

import pytest
import torch

# Bitwise reproducibility depends on the thread count (SPEC §8): pin it. One thread: the tiny
# test models gain nothing from two, and two threads per process oversubscribe a 2-core machine.
torch.set_num_threads(int(os.environ.get("DGEMMA_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
