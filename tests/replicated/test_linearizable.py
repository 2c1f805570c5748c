"""The linearizability checker: it accepts the histories a correct register may produce and
refuses the ones it may not (each refusal a bug it must be able to see)."""

from __future__ import annotations

import random

from fenced.testing.check._linearizable import RegisterOp, check_register


def w(value: str, start: float, end: float | None) -> RegisterOp:
    return RegisterOp("write", value, start, end, f"w{value}")


def r(value: str | None, start: float, end: float) -> RegisterOp:
    return RegisterOp("read", value, start, end, f"r{value}@{start}")


def test_sequential_history_is_linearizable() -> None:
    assert check_register([w("1", 0, 1), r("1", 2, 3), w("2", 4, 5), r("2", 6, 7)]) is None


def test_a_read_may_see_a_concurrent_write_or_not() -> None:
    assert check_register([w("1", 0, 1), w("2", 2, 10), r("1", 3, 4)]) is None
    assert check_register([w("1", 0, 1), w("2", 2, 10), r("2", 3, 4)]) is None


def test_a_stale_read_after_the_write_was_acknowledged_is_caught() -> None:
    why = check_register([w("1", 0, 1), w("2", 2, 3), r("1", 4, 5)])
    assert why is not None and "not linearizable" in why


def test_a_value_seen_then_unseen_is_caught() -> None:
    """The read-repair case: a write in flight seen by one read must be seen by every later
    read (a write that reached one replica and then vanished)."""
    history = [w("1", 0, 1), w("2", 2, None), r("2", 3, 4), r("1", 5, 6)]
    assert check_register(history) is not None


def test_an_unknown_write_may_take_effect_late_or_never() -> None:
    assert check_register([w("1", 0, 1), w("2", 2, None), r("1", 3, 4)]) is None
    assert check_register([w("1", 0, 1), w("2", 2, None), r("1", 3, 4), r("2", 9, 10)]) is None


def test_a_read_of_a_value_never_written_is_caught() -> None:
    assert check_register([w("1", 0, 1), r("7", 2, 3)]) is not None
    assert check_register([r(None, 0, 1)]) is None  # the initial value


def test_random_histories_of_a_real_register_pass_and_corrupted_ones_fail() -> None:
    rng = random.Random(7)
    for trial in range(50):
        # A real (atomic) register: each op takes effect at one instant inside its interval.
        value: str | None = None
        ops: list[RegisterOp] = []
        t = 0.0
        for i in range(30):
            t += rng.uniform(0.1, 1)
            start = t - rng.uniform(0, 2)
            end = t + rng.uniform(0, 2)
            if rng.random() < 0.4:
                value = f"{trial}.{i}"
                ops.append(w(value, start, end))
            else:
                ops.append(r(value, start, end))
        assert check_register(ops) is None
        # Corrupt one read to return a value overwritten well before it started.
        writes = [o for o in ops if o.kind == "write"]
        reads = [o for o in ops if o.kind == "read" and o.start > writes[0].end + 0.001]
        late = [
            o for o in reads if any(x.start > writes[0].end and x.end < o.start for x in writes[1:])
        ]
        if late:
            bad = late[-1]
            corrupted = [o if o is not bad else r(writes[0].value, o.start, o.end) for o in ops]
            assert check_register(corrupted) is not None
