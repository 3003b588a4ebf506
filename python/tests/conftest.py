# pytest setup for kiln's Python tests: fresh random seeds (printed, replayable with
# KILN_TEST_SEED), and the `rng` fixture.
import os
import random

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("KILN_TEST_SEED", random.randrange(1 << 31)))
    print(f"{request.node.name}: KILN_TEST_SEED={seed}")
    return np.random.default_rng(seed)
