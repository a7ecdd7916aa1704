"""Replica threads: turn-taking at collectives, and state each replica keeps as its own."""

import pytest

from keras_strategies.backend.common import replica_threads


class SharedSlot(replica_threads.ThreadState):
    """One shared attribute that each replica must see as its own (like torch's `.grad`)."""

    def __init__(self, size):
        self.current = None
        self.saved = {k: None for k in range(size)}
        self.log = []

    def save(self, replica_id):
        self.saved[replica_id] = self.current
        self.log.append(("save", replica_id))

    def restore(self, replica_id):
        self.current = self.saved[replica_id]
        self.log.append(("restore", replica_id))


def test_each_replica_keeps_its_own_state_across_collectives():
    slot = SharedSlot(3)

    def replica(replica_id):
        slot.current = f"replica {replica_id}, step 1"
        replica_threads.exchange(replica_id)
        seen = [slot.current]
        slot.current = f"replica {replica_id}, step 2"
        replica_threads.exchange(replica_id)
        return seen + [slot.current]

    results = replica_threads.run(replica, 3, state=slot)
    assert results == [[f"replica {k}, step 1", f"replica {k}, step 2"] for k in range(3)]
    # Control passes only at collectives: every hand-off saves, every resumption restores.
    assert slot.log[:2] == [("restore", 0), ("save", 0)]
    assert slot.log.count(("save", 0)) == slot.log.count(("restore", 0)) == 3


def test_without_thread_state_replicas_see_each_others_writes():
    box = {}

    def replica(replica_id):
        box["value"] = replica_id
        replica_threads.exchange(replica_id)
        return box["value"]

    # The last replica to reach the collective wrote last: everyone reads its value.
    assert replica_threads.run(replica, 2) == [1, 1]


def test_a_failing_replica_stops_the_others():
    def replica(replica_id):
        if replica_id == 1:
            raise ValueError("replica 1 failed")
        replica_threads.exchange(replica_id)

    with pytest.raises(ValueError, match="replica 1 failed"):
        replica_threads.run(replica, 2, state=SharedSlot(2))
