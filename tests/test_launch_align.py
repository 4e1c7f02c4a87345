"""The host rendezvous before collective launches (csrc/launch_align.cc).

The CUDA handlers call it; here Python threads play the devices' host
threads, calling the same native entry point with the GIL released.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import setup

import jaxtdist as td
from jaxtdist.runtime import _native
from jaxtdist.runtime._runtime import LAUNCH_ALIGN_SPIN_US, LAUNCH_ALIGN_TIMEOUT_US


@pytest.fixture
def aligner():
    lib = _native.native()
    yield lib  # each test configures it: no pending rendezvous, counters at zero
    lib.configure_launch_alignment(True, LAUNCH_ALIGN_TIMEOUT_US, LAUNCH_ALIGN_SPIN_US)


def _run_members(lib, members, world, epochs, counter=7, leader=0, stagger_s=0.0):
    """Each member thread arrives for every epoch; returns per-thread wait times (s)."""
    waits = [[] for _ in range(members)]
    errors = []

    def member(i):
        try:
            for e in epochs:
                if stagger_s:
                    time.sleep(stagger_s * i)
                t0 = time.perf_counter()
                lib.align_launch(counter, e, leader, world, position=i)
                waits[i].append(time.perf_counter() - t0)
        except Exception as err:  # noqa: BLE001 - surfaced below
            errors.append(err)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a member never returned"
    assert not errors, errors
    return waits


# Arrivals that only spin, spin then sleep (the default), and only sleep.
SPINS_US = [5_000_000, LAUNCH_ALIGN_SPIN_US, 0]


@pytest.mark.parametrize("spin_us", SPINS_US)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_member_meets(aligner, world, spin_us):
    aligner.configure_launch_alignment(True, 5_000_000, spin_us)
    epochs = range(1, 41)
    _run_members(aligner, world, world, epochs)
    stats = aligner.launch_alignment_stats()
    assert {k: stats[k] for k in ("enabled", "met", "timed_out", "disabled_because")} == dict(
        enabled=True, met=world * len(epochs), timed_out=0, disabled_because="")
    assert stats["late"] == [] and 0 <= stats["max_spread_us"] < 5_000_000


@pytest.mark.parametrize("spin_us", SPINS_US)
def test_early_member_waits_for_a_late_one(aligner, spin_us):
    aligner.configure_launch_alignment(True, 5_000_000, spin_us)
    # Member i arrives 20 ms * i late: member 0 must wait about 60 ms, and a
    # sleeping member is woken by the last arrival, not by the timeout (5 s).
    waits = _run_members(aligner, 4, 4, [1], stagger_s=0.02)
    assert 0.04 < waits[0][0] < 1.0, waits
    assert waits[3][0] < 0.03, waits
    assert aligner.launch_alignment_stats()["met"] == 4


def test_late_rendezvous_name_the_late_member(aligner):
    aligner.configure_launch_alignment(True, 5_000, LAUNCH_ALIGN_SPIN_US)
    # Positions 0-2 come at once, position 3 50 ms later: the three time out
    # (5 ms), and the record says position 3 arrived about 50 ms after the first.
    # Each member's thread lives until position 3 has come: a thread that timed out
    # and ended could lend its id to one started after it on a loaded machine, and
    # the aligner (rightly) gives up where one thread launches two members.
    last_came = threading.Event()

    def member(position):
        aligner.align_launch(5, 1, 0, 4, position=position)
        last_came.wait(60)

    threads = [threading.Thread(target=member, args=(position,)) for position in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    aligner.align_launch(5, 1, 0, 4, position=3)
    last_came.set()
    for t in threads:
        t.join(timeout=60)
    stats = aligner.launch_alignment_stats()
    assert stats["timed_out"] == 3 and stats["met"] == 1, stats
    [record] = stats["late"]
    assert (record["counter"], record["epoch"]) == (5, 1)
    assert [m["position"] for m in record["members"]][-1] == 3
    last = record["members"][-1]
    assert last["arrived_us"] > 30_000 and last["entered_us"] <= last["arrived_us"], record
    assert sorted(m["position"] for m in record["members"]) == [0, 1, 2, 3]
    assert stats["max_spread_us"] >= last["arrived_us"]


def test_groups_and_counters_meet_separately(aligner):
    aligner.configure_launch_alignment(True, 5_000_000, LAUNCH_ALIGN_SPIN_US)
    threads = [threading.Thread(target=_run_members, args=(aligner, 2, 2, range(1, 11)),
                                kwargs=dict(counter=c, leader=leader))
               for c in (1, 2) for leader in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    stats = aligner.launch_alignment_stats()
    assert stats["met"] == 4 * 2 * 10 and stats["timed_out"] == 0


def test_missing_member_times_out_then_alignment_turns_off(aligner):
    aligner.configure_launch_alignment(True, 2_000, LAUNCH_ALIGN_SPIN_US)
    # 3 of 4 members come: every rendezvous times out (2 ms), none hangs.
    _run_members(aligner, 3, 4, range(1, 11))
    stats = aligner.launch_alignment_stats()
    assert stats["timed_out"] >= 8
    assert not stats["enabled"]
    assert "timed out" in stats["disabled_because"]
    # Off: arrivals return at once.
    t0 = time.perf_counter()
    aligner.align_launch(7, 99, 0, 4)
    assert time.perf_counter() - t0 < 0.5


def test_one_thread_for_several_members_turns_alignment_off(aligner):
    aligner.configure_launch_alignment(True, 2_000, LAUNCH_ALIGN_SPIN_US)
    # One thread launching every device's program in turn: the second arrival
    # for the same call recognises it and stops waiting for good.
    for _ in range(4):
        aligner.align_launch(3, 1, 0, 4)
    stats = aligner.launch_alignment_stats()
    assert not stats["enabled"]
    assert "one host thread" in stats["disabled_because"]
    assert stats["timed_out"] == 1


def test_turned_off_never_waits(aligner):
    aligner.configure_launch_alignment(False, 5_000_000, LAUNCH_ALIGN_SPIN_US)
    t0 = time.perf_counter()
    aligner.align_launch(1, 1, 0, 4)
    assert time.perf_counter() - t0 < 0.5
    stats = aligner.launch_alignment_stats()
    assert stats["enabled"] is False and stats["met"] == 0
    assert "align_launches=False" in stats["disabled_because"]


def test_initialize_toggles_alignment_without_a_new_runtime():
    mesh = setup(4)
    rt = td.runtime.runtime()
    try:
        same = td.initialize(mesh, align_launches=False)
        assert same is rt and not rt.align_launches
        assert rt.launch_alignment_stats()["enabled"] is False
        td.initialize(mesh, align_launches=True)
        assert rt.align_launches and rt.launch_alignment_stats()["enabled"] is True
    finally:
        rt.align_launches = True
