"""The frontend's end of a core's sockets when no core is connected (it died, not noticed yet): a
send neither blocks for good nor keeps the link from closing. A blocking send there once held the
lock that closing takes while the dead core's reader thread, holding the cores' lock, waited for
it: the two-core test hung in CI."""

from __future__ import annotations

import threading

from mm_engine.core import messages as m
from mm_engine.engine.process_client import _Link


class _Unconnected(_Link):
    def __init__(self, folder) -> None:
        super().__init__(f"ipc://{folder}/in", f"ipc://{folder}/out")
        self.core_alive = True

    @property
    def alive(self) -> bool:
        return self.core_alive


def test_a_send_to_a_dead_core_is_dropped(tmp_path):
    link = _Unconnected(tmp_path)
    link.core_alive = False
    sender = threading.Thread(target=link.send, args=(m.Shutdown(),), daemon=True)
    sender.start()
    sender.join(5)
    assert not sender.is_alive(), "a send to a dead core waited"  # nobody will read it
    link._close_sockets()


def test_a_waiting_send_lets_the_link_close_and_then_gives_up(tmp_path):
    link = _Unconnected(tmp_path)
    sender = threading.Thread(target=link.send, args=(m.Shutdown(),), daemon=True)
    sender.start()  # no core connected, and it looks alive: the send waits
    sender.join(0.2)
    assert sender.is_alive()
    closer = threading.Thread(target=link._close_sockets, daemon=True)
    closer.start()
    closer.join(5)
    assert not closer.is_alive(), "closing waited on the send"
    sender.join(5)
    assert not sender.is_alive(), "the send outlived the closed link"


def test_a_send_with_a_timeout_gives_up(tmp_path):
    link = _Unconnected(tmp_path)
    link.send(m.Shutdown(), timeout_s=0.05)
    link._close_sockets()
