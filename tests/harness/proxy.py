"""A loopback TCP proxy a test puts between processes and a service (PostgreSQL, Redis), to do
to that service what a network does: cut every connection and refuse new ones, delay every
byte, then give it back.

The service itself is never touched: other tests on this machine use the same PostgreSQL, and
a process behind the proxy sees exactly what it would see of a store across a broken or slow
network. One proxy may serve one process (a partition of one host) or every process of a
test (the store gone for everyone).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import threading
import time

# SO_LINGER on, zero seconds: close() sends a reset, as a firewall rejecting the flow does.
_RESET = struct.pack("ii", 1, 0)
_EOF = b""


class TcpProxy:
    """Forwards connections on a port of its own to ``target_port`` on loopback.

    :meth:`cut` ends every connection at once and refuses new ones; :meth:`delay` holds every
    chunk, each way, for a number of seconds before passing it on (so a statement's round trip
    takes twice that, plus what the store takes); :meth:`restore` ends both."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(256)
        self.port = int(self.listener.getsockname()[1])
        self.cut_off = threading.Event()
        self.delay_s = 0.0
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.accepted = 0  # connections forwarded, over the proxy's life
        self.refused = 0  # connections refused while cut
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut_off.is_set():
                self.refused += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                _reset(client)
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self.sockets += [client, upstream]
                self.accepted += 1
            ends = threading.Semaphore(0)
            for source, sink in ((client, upstream), (upstream, client)):
                _Pipe(self, source, sink, ends).start()
            threading.Thread(
                target=self._close_when_done, args=(client, upstream, ends), daemon=True
            ).start()

    def _close_when_done(
        self, client: socket.socket, upstream: socket.socket, ends: threading.Semaphore
    ) -> None:
        """Once both directions are over, close the pair (a cut may have done so already)."""
        ends.acquire()
        ends.acquire()
        with self.lock:
            self.sockets = [s for s in self.sockets if s is not client and s is not upstream]
        client.close()
        upstream.close()

    def cut(self) -> None:
        """End every connection at once (both sides see it reset, as when a firewall starts
        rejecting) and refuse new ones until :meth:`restore`."""
        self.cut_off.set()
        with self.lock:
            sockets, self.sockets = self.sockets, []
        for sock in sockets:
            # A thread blocked in recv() on this socket keeps it open through close();
            # shutdown() wakes it, so the far end learns now, not at the next write.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def delay(self, seconds: float) -> None:
        """From now on every chunk, each way, is passed on ``seconds`` after it arrived (the
        order kept); connections stay up. 0 ends the delay (what is held still waits its
        time)."""
        self.delay_s = max(0.0, seconds)

    def restore(self) -> None:
        """Connections are accepted and passed on at once again."""
        self.delay_s = 0.0
        self.cut_off.clear()

    def close(self) -> None:
        self.cut()
        self.listener.close()


class _Pipe:
    """One direction of one connection: a reader that stamps each chunk with when it may go,
    and a writer that sends it then (at once while there is no delay)."""

    def __init__(
        self,
        proxy: TcpProxy,
        source: socket.socket,
        sink: socket.socket,
        ends: threading.Semaphore,
    ) -> None:
        self.proxy = proxy
        self.source = source
        self.sink = sink
        self.ends = ends
        self.chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        try:
            while data := self.source.recv(65536):
                self.chunks.put((time.monotonic() + self.proxy.delay_s, data))
        except OSError:
            pass
        self.chunks.put((time.monotonic() + self.proxy.delay_s, _EOF))

    def _write(self) -> None:
        try:
            while True:
                due, data = self.chunks.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if data is _EOF or not data:
                    break
                self.sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (self.source, self.sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self.ends.release()


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    sock.close()
