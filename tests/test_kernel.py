from hypothesis import given
from hypothesis import strategies as st

from libra.sim.kernel import Kernel, SimulationError


def test_order_and_tiebreak():
    k, seen = Kernel(), []
    k.at(2.0, seen.append, "b")
    k.at(1.0, seen.append, "a")
    k.at(2.0, seen.append, "c")  # same time as "b": scheduled later, runs later
    k.run()
    assert seen == ["a", "b", "c"] and k.now == 2.0


def test_cancel_and_until():
    k, seen = Kernel(), []
    h = k.after(1.0, seen.append, 1)
    k.after(3.0, seen.append, 3)
    h.cancel()
    k.run(until=2.0)
    assert seen == [] and k.now == 2.0
    k.run()
    assert seen == [3]


def test_past_event_rejected():
    k = Kernel()
    k.at(5.0, lambda: None)
    k.run()
    try:
        k.at(1.0, lambda: None)
    except SimulationError:
        return
    raise AssertionError("scheduling in the past must fail")


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), max_size=200), st.integers(0, 2**32))
def test_time_never_goes_backwards(delays, seed):
    k = Kernel(seed)
    times = []
    for d in delays:
        k.after(d, lambda: times.append(k.now))
    k.run()
    assert times == sorted(times) and len(times) == len(delays)


def test_events_can_schedule_events_deterministically():
    def run(seed):
        k, out = Kernel(seed), []

        def tick(n):
            out.append((k.now, n))
            if n:
                k.after(k.rng.random(), tick, n - 1)

        k.after(0, tick, 50)
        k.run()
        return out

    assert run(7) == run(7) and run(7) != run(8)
