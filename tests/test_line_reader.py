"""The chat's line reader: Ctrl-C interrupts the wait for a line whichever thread takes SIGINT,
and lines that arrive together are handed out one by one."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from dflash2_mlx.cli.line_reader import LineReader


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def test_lines_of_a_paste_come_one_by_one_then_a_last_line_without_newline_then_eof(pipe, capsys):
    r, w = pipe
    os.write(w, "first\nsecond\r\nthird ✓".encode())
    os.close(w)
    reader = LineReader(r)
    assert [reader.read(">>> ") for _ in range(3)] == ["first", "second", "third ✓"]
    with pytest.raises(EOFError):
        reader.read(">>> ")
    assert capsys.readouterr().out == ">>> " * 4


def test_sigint_taken_by_another_thread_interrupts_the_wait(pipe):
    """The case input() gets wrong: the signal lands in a non-main thread (MLX's and the BLAS's
    threads are candidates), so the main thread's blocking read was never interrupted."""
    r, w = pipe
    reader = LineReader(r)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    done = threading.Event()

    def other_thread():
        time.sleep(0.2)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # delivered to this thread
        if not done.wait(5):
            os.write(w, b"too late\n")  # only reached if the read was not interrupted

    helper = threading.Thread(target=other_thread, daemon=True)
    helper.start()
    try:
        started = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            reader.read("")
        assert time.perf_counter() - started < 4.0  # interrupted, not woken by the late line
    finally:
        done.set()
        helper.join()
        signal.signal(signal.SIGINT, previous)
    reader.clear()
    os.write(w, b"next\n")
    assert reader.read("") == "next"
