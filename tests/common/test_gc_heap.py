"""`freeze_startup_heap` in a child process of its own (a freeze is for the life of a process): what start-up
built leaves the collector's generations, what serving allocates after it is still collected."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import gc, json, weakref
from lockstep_common.gc_heap import freeze_startup_heap

class Node:
    pass

startup = [[i] for i in range(50_000)]  # start-up's objects: the model's, the tokenizer's
garbage = Node(); garbage.me = garbage  # start-up's garbage: a cycle no one holds
gone = weakref.ref(garbage); del garbage
frozen = freeze_startup_heap()
later = Node(); later.me = later  # serving's garbage after the freeze
later_ref = weakref.ref(later); del later
walked = gc.get_objects(generation=2)
gc.collect()
print(json.dumps({"frozen": frozen, "startup_walked": any(o is startup[0] for o in walked),
                  "startup_garbage_collected": gone() is None, "later_collected": later_ref() is None}))
"""


def test_start_ups_objects_leave_the_generations_and_later_garbage_is_still_collected():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(result.stdout)
    assert report["frozen"] >= 50_000
    assert not report["startup_walked"]  # a full collection no longer walks them
    assert report["startup_garbage_collected"]  # the collection before the freeze took start-up's garbage
    assert report["later_collected"]
