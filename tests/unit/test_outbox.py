"""The outbox sends in the order messages were put, from its own thread, and a failing send does
not stop the ones after it."""

from __future__ import annotations

import threading

from mm_engine.engine.outbox import Outbox


def test_items_are_delivered_in_order_on_the_outbox_thread_past_a_failure():
    seen = []

    def deliver(item):
        if item == 3:
            raise OSError("the core died meanwhile")
        seen.append((item, threading.current_thread().name))

    box = Outbox(deliver, name="test-outbox")
    for i in range(100):
        box.put(i)
    box.close()  # sends what was put, then stops
    assert [i for i, _ in seen] == [i for i in range(100) if i != 3]
    assert {name for _, name in seen} == {"test-outbox"}
