"""The side channel between a joining replica and its core partner: framed messages over TCP.

Why a socket of its own and not the core's gloo group: the core group is fixed (its members and
its all-reduce never change), and a joiner must be able to appear, fall behind, hang or die
without any core collective noticing. A plain TCP stream gives exactly that: ordered delivery,
a SIGKILLed peer shows up at once as end-of-stream, and a hung one as a receive timeout on a
background thread, so the core's training thread never blocks on a joiner it does not need.

Every message carries the hybrid slot, the join generation, a training step and the membership
epoch, so the receiver can reject what belongs to an abandoned join, a past step or an older
membership. Payloads are raw float32 gradient bytes or a `torch.save` snapshot.
"""

from __future__ import annotations

import socket
import struct
import threading
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

# kind, slot, generation, step, epoch, arg, payload bytes
_HEADER = struct.Struct("!BIIqqqQ")
MAX_PAYLOAD = 1 << 36  # a frame claiming more is corrupt, not a snapshot


class Kind(IntEnum):
    HELLO = 1  # joiner -> partner: I am slot S (generation 0: the partner assigns one)
    WELCOME = 2  # partner -> joiner: your join's generation
    SNAPSHOT = 3  # partner -> joiner: weights + optimizer state after `step`
    RESTORED = 4  # joiner -> partner: snapshot loaded (step = the snapshot's step)
    REDUCED = 5  # partner -> joiner: the summed gradient of `step`; arg = slots that count at step + 1
    ZERO = 6  # joiner -> partner: zero gradients for `step` (ZERO_SYNC, ACTIVATING)
    GRAD = 7  # joiner -> partner: its gradients for `step` (ACTIVE)
    PROPOSE = 8  # partner -> joiner: count from step `step` (arg unused); epoch = the current one
    ACK = 9  # joiner -> partner: I will count from `step`, under `epoch`
    RELEASE = 10  # partner -> joiner: you no longer count after `step`; leave
    BYE = 11  # joiner -> partner: left cleanly after `step`


class ChannelClosed(ConnectionError):
    """The peer closed the stream or the stream broke (a killed peer shows up as this)."""


@dataclass(slots=True)
class Msg:
    kind: Kind
    slot: int
    generation: int
    step: int
    epoch: int = 0
    arg: int = 0
    payload: bytes = b""


class Channel:
    """One TCP stream of `Msg` frames; `send` is thread-safe, `recv` has one reader."""

    __slots__ = ("sock", "_send_lock")

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self._send_lock = sock, threading.Lock()

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float) -> Channel:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.settimeout(None)
        return cls(sock)

    def send(self, m: Msg) -> None:
        head = _HEADER.pack(int(m.kind), m.slot, m.generation, m.step, m.epoch, m.arg, len(m.payload))
        try:
            with self._send_lock:
                self.sock.sendall(head)
                if m.payload:
                    self.sock.sendall(m.payload)
        except OSError as e:
            raise ChannelClosed(str(e)) from None

    def recv(self, timeout_s: float | None = None) -> Msg:
        """The next message; `TimeoutError` if none within `timeout_s`, `ChannelClosed` at the end."""
        self.sock.settimeout(timeout_s)
        head = self._exactly(_HEADER.size, timeout_ok=True)
        kind, slot, gen, step, epoch, arg, n = _HEADER.unpack(head)
        if n > MAX_PAYLOAD:
            raise ChannelClosed(f"corrupt frame: payload of {n} bytes")
        self.sock.settimeout(None)  # a started frame is read to its end
        try:
            kind = Kind(kind)
        except ValueError:
            raise ChannelClosed(f"corrupt frame: kind {kind}") from None
        return Msg(kind, slot, gen, step, epoch, arg, self._exactly(n) if n else b"")

    def _exactly(self, n: int, timeout_ok: bool = False) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:])
            except TimeoutError:
                if timeout_ok and got == 0:
                    raise
                raise ChannelClosed("timed out inside a frame") from None
            except OSError as e:
                raise ChannelClosed(str(e)) from None
            if k == 0:
                raise ChannelClosed("end of stream")
            got += k
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def tensor_bytes(t: Tensor) -> bytes:
    return t.detach().contiguous().numpy().tobytes()


def bytes_tensor(b: bytes, like: Tensor) -> Tensor:
    """A float tensor of `like`'s size and dtype from raw bytes; a size mismatch is a corrupt frame."""
    want = like.numel() * like.element_size()
    if len(b) != want:
        raise ChannelClosed(f"corrupt gradient: {len(b)} bytes where {want} were expected")
    return torch.frombuffer(bytearray(b), dtype=like.dtype)
