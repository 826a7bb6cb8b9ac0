"""Units of the live elastic layer without processes: the side channel's framing, the membership
table every core rank applies, and the token-balanced training layout."""

from __future__ import annotations

import socket
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.runtime.elastic.membership import CONTROL_FIELDS, Field, Membership, Op, partner_of
from libra.runtime.elastic.wire import Channel, ChannelClosed, Kind, Msg, bytes_tensor, tensor_bytes
from libra.runtime.layout import balance_by_tokens, owner_of


@pytest.fixture
def pair():
    """Two ends of a real loopback TCP connection (an ephemeral port)."""
    server = socket.create_server(("127.0.0.1", 0))
    ca = Channel.connect("127.0.0.1", server.getsockname()[1], 5.0)
    cb = Channel(server.accept()[0])
    server.close()
    yield ca, cb
    ca.close()
    cb.close()


def test_messages_round_trip_with_payloads(pair):
    a, b = pair
    grad = torch.randn(1000)
    sent = [
        Msg(Kind.HELLO, 3, 0, -1),
        Msg(Kind.GRAD, 3, 7, 12, 2, 0, tensor_bytes(grad)),
        Msg(Kind.REDUCED, 3, 7, 12, 2, 0b1010, b"x" * 5),
    ]
    for m in sent:
        a.send(m)
    got = [b.recv(5.0) for _ in sent]
    assert got == sent
    assert torch.equal(bytes_tensor(got[1].payload, grad), grad)


def test_end_of_stream_timeout_and_corrupt_frames(pair):
    a, b = pair
    with pytest.raises(TimeoutError):
        b.recv(0.05)  # nothing yet: a timeout, not an error
    a.sock.sendall(struct.pack("!BIIqqqQ", 99, 0, 0, 0, 0, 0, 0))
    with pytest.raises(ChannelClosed, match="kind 99"):
        b.recv(5.0)
    a.close()
    with pytest.raises(ChannelClosed):
        b.recv(5.0)
    with pytest.raises(ChannelClosed, match="corrupt gradient"):
        bytes_tensor(b"abc", torch.zeros(4))


def table(slots: int, **rows: tuple[Op, int]) -> torch.Tensor:
    t = torch.zeros(slots, CONTROL_FIELDS, dtype=torch.int64)
    for name, (op, release) in rows.items():
        s = int(name[1:])
        t[s, Field.OP], t[s, Field.RELEASE_REQUEST] = op, release
    return t


def test_membership_changes_bump_the_epoch_once_per_exchange():
    m = Membership(core=2, slots=3)
    assert m.apply(table(3, s0=(Op.ACTIVATE, 0), s2=(Op.ACTIVATE, 0)))
    assert (m.active, m.epoch, m.size, m.index_of(2)) == ((0, 2), 1, 4, 3)
    assert not m.apply(table(3))  # nothing: the same epoch
    assert m.apply(table(3, s0=(Op.NONE, 1), s2=(Op.REMOVE, 0)))  # a release request and a failure
    assert (m.active, m.epoch) == ((), 2)
    assert not m.apply(table(3, s1=(Op.NONE, 1)))  # releasing a slot that does not count: no change
    assert Membership.from_mask(2, 3, 5, 0b101).active == (0, 2)
    assert [partner_of(s, 2) for s in range(4)] == [0, 1, 0, 1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40_000), max_size=64), st.integers(1, 8))
def test_layout_gives_every_sample_to_exactly_one_rank_balanced_by_tokens(tokens, ranks):
    shares = balance_by_tokens(tokens, ranks)
    assert len(shares) == ranks
    assert sorted(i for s in shares for i in s) == list(range(len(tokens)))
    assert all(s == sorted(s) for s in shares)
    loads = [sum(tokens[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(tokens, default=0)  # LPT's bound
    assert balance_by_tokens(tokens, ranks) == shares  # deterministic
    assert len(owner_of(shares)) == len(tokens)


def test_layout_rejects_zero_ranks():
    with pytest.raises(ValueError, match="ranks"):
        balance_by_tokens([1, 2], 0)
