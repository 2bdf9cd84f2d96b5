import os

import pytest
import torch

# Bitwise reproducibility depends on the thread count (SPEC §8); pin it for the suite.
torch.set_num_threads(int(os.environ.get("DGEMMA_TEST_THREADS", "2")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
