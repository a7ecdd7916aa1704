"""The launcher relays every line of its workers except the engines' lines that say nothing to act on."""

import io
import os
import threading

from keras_strategies.console.worker_output import is_engine_noise
from keras_strategies.launcher.processes import LineWriter, _pump

GLOO_LINE = "[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"


def test_gloos_connection_line_is_noise_and_nothing_else():
    assert is_engine_noise(GLOO_LINE) and is_engine_noise(GLOO_LINE + "\r")
    for line in ("[Gloo] Rank 1 is connected to 2 peer ranks. Expected number of connected peer ranks is : 3 (missing)",
                 "Epoch 1/3", "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer",
                 "print([Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1)"):
        assert not is_engine_noise(line), line


def test_gloo_lines_written_at_once_by_two_threads_are_noise_in_every_piece():
    # Each communicator's thread writes its line a piece at a time: two at once interleave.
    interleaved = ("[Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
                   "0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
                   "[Gloo] Rank 0[Gloo] Rank  is connected to 1 is connected to 1 peer ranks. 1 peer ranks. "
                   "Expected number of connected peer ranks is : Expected number of connected peer ranks is : 11")
    for line in interleaved:
        assert is_engine_noise(line) and is_engine_noise(line + "\r"), line
    for line in ("0", "1 2", "Step 3 is connected to the previous one", "[Gloo] Rank 0 said: hello"):
        assert not is_engine_noise(line), line


def test_the_pump_drops_only_the_noise():
    read, write = os.pipe()
    os.write(write, f"Epoch 1/1\n{GLOO_LINE}\nloss: 0.25\n".encode())
    os.close(write)
    out = io.StringIO()
    thread = threading.Thread(target=_pump, args=(os.fdopen(read, "rb"), "[worker 0] ", LineWriter(out, threading.Lock())))
    thread.start()
    thread.join(10)
    assert out.getvalue() == "[worker 0] Epoch 1/1\n[worker 0] loss: 0.25\n"
