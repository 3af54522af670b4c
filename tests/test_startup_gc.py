"""Start-up's objects leave the garbage collector's passes (seqserve_common/startup_gc.py)."""

import gc

from seqserve_common.startup_gc import freeze_startup_objects


def test_objects_made_before_the_freeze_leave_the_collectors_passes_and_later_ones_stay():
    made_at_start_up = [[] for _ in range(100)]
    try:
        frozen = freeze_startup_objects()
        made_later = [[]]
        in_passes = {id(o) for o in gc.get_objects()}
        # At least: in one full run of the suite the count read here was 2 more than the
        # one returned (only gc.freeze adds to it, so another thread of the test process
        # froze meanwhile).
        assert gc.get_freeze_count() >= frozen >= len(made_at_start_up)
        assert id(made_at_start_up) not in in_passes
        assert not any(id(o) in in_passes for o in made_at_start_up)
        assert id(made_later) in in_passes
    finally:
        gc.unfreeze()
