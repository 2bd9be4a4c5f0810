"""The write pace (pacing.py): a token bucket whose turns are handed out in order, on a fake clock."""

from __future__ import annotations

import threading

from tpuft_operator.pacing import WritePace


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_goes_at_once_then_turns_come_at_the_rate() -> None:
    clock = Clock()
    pace = WritePace(10, 3, clock=clock)
    turns = [round(pace.reserve() - clock.now, 9) for _ in range(6)]
    assert turns == [0, 0, 0, 0.1, 0.2, 0.3]


def test_a_quiet_spell_refills_the_bucket_up_to_the_burst_only() -> None:
    clock = Clock()
    pace = WritePace(10, 2, clock=clock)
    for _ in range(4):
        pace.reserve()  # two now, two ahead: 0.1 s and 0.2 s
    clock.now += 60  # a minute of quiet refills two tokens, not 600
    assert [round(pace.reserve() - clock.now, 9) for _ in range(3)] == [0, 0, 0.1]


def test_turns_handed_out_ahead_are_kept_by_a_later_writer() -> None:
    """A turn in the future stays taken: the next writer's comes after it, whoever asks first later."""
    clock = Clock()
    pace = WritePace(2, 1, clock=clock)
    first, second = pace.reserve(), pace.reserve()
    assert (first, second) == (clock.now, clock.now + 0.5)
    clock.now += 0.25
    assert pace.due_in(second) == 0.25 and pace.due_in(first) == 0
    assert pace.reserve() == 101.0  # after the second's turn, not before it


def test_without_a_rate_every_turn_is_now() -> None:
    clock = Clock()
    pace = WritePace(0, 1, clock=clock)
    assert not pace.limited
    assert {pace.reserve() for _ in range(1000)} == {clock.now}


def test_wait_sleeps_until_its_turn() -> None:
    clock = Clock()
    pace = WritePace(4, 1, clock=clock)
    slept: list[float] = []
    assert pace.wait(slept.append) == 0
    assert pace.wait(slept.append) == 0.25
    assert slept == [0.25]  # the first turn was free: no sleep at all


def test_writers_on_many_threads_get_distinct_turns() -> None:
    clock = Clock()
    pace = WritePace(100, 5, clock=clock)
    turns: list[float] = []
    lock = threading.Lock()

    def take() -> None:
        for _ in range(50):
            turn = pace.reserve()
            with lock:
                turns.append(turn)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    offsets = sorted(round((t - clock.now) * 100) for t in turns)  # in turns of 1/rate
    assert offsets == [0] * 5 + list(range(1, 400 - 4))
