from __future__ import annotations

import itertools

from rawmm.config import RUN_SEED_LIMIT
from rawmm.contract.engine_api import SEED_LIMIT
from rawmm.rl.orchestrator.rollout import RolloutId, request_seed


def test_request_seed_is_the_same_in_every_process():
    # Pinned once from the implementation: a restarted orchestrator (another process, another
    # PYTHONHASHSEED, another release) must send the very seeds the first one sent.
    assert request_seed(0, RolloutId(1, 0, 0), 0) == 1894581050
    assert request_seed(0, RolloutId(1, 0, 0), 1) == 1691077466
    assert request_seed(7, RolloutId(3, 2, 5), 4) == 105724888
    assert request_seed(RUN_SEED_LIMIT - 1, RolloutId(100, 15, 7), 9) == 453817499


def test_request_seed_differs_for_every_run_rollout_and_turn():
    runs, steps, groups, indices, turns = (0, 1, 7), (1, 2, 12), (0, 1, 3, 23), (0, 1, 2), (0, 1, 2, 3)
    keys = list(itertools.product(runs, steps, groups, indices, turns))
    seeds = {request_seed(run, RolloutId(step, group, index), turn) for run, step, group, index, turn in keys}
    # Every field on its own changes the seed; (step 1, group 23) and (step 12, group 3) are apart too.
    assert len(seeds) == len(keys)
    assert all(0 <= seed < SEED_LIMIT for seed in seeds)
