"""``meshrl.reshard.transport.wait_work``: a bucket's wait is bounded and returns as soon as the work is done.

The polling path (the one NCCL takes) runs here on a real c10d ``Work`` backed by a future, so
completion is under the test's control; gloo's own blocking wait is covered by the push tests.
"""

from __future__ import annotations

import threading
import time

import torch
from torch._C._distributed_c10d import _create_work_from_future

from meshrl.reshard.transport import wait_work


def test_polled_wait_times_out_at_the_deadline_and_returns_once_done():
    fut = torch.futures.Future()
    work = _create_work_from_future(fut)
    start = time.monotonic()
    assert not wait_work(work, start + 0.2, cuda=True)  # never completed: False at the deadline, no hang
    assert 0.2 <= time.monotonic() - start < 2.0

    timer = threading.Timer(0.05, fut.set_result, args=(None,))
    timer.start()
    start = time.monotonic()
    assert wait_work(work, start + 10.0, cuda=True)
    assert time.monotonic() - start < 2.0  # returned when the work completed, not at the deadline
    timer.join()
