import subprocess
import sys

import pytest

from atrctl.runtime import allocator

pytestmark = pytest.mark.skipif(not allocator.is_glibc(), reason="the thresholds are glibc's")

PROBE = """
import ctypes, sys
libc = ctypes.CDLL(None)
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes, libc.sbrk.argtypes = [ctypes.c_size_t], [ctypes.c_void_p], [ctypes.c_long]
if sys.argv[1] == "kept":
    from atrctl.runtime.allocator import keep_freed_memory
    assert keep_freed_memory()
for size in (1 << 20, 16 << 20):
    block = libc.malloc(size)
    top = libc.sbrk(0)  # the program break: heap blocks lie below it, mmapped ones elsewhere
    ctypes.memset(block, 1, size)
    libc.free(block)
    print(block < top, libc.sbrk(0) == top)
"""


def where_blocks_go(arm: str) -> list[str]:
    """Per block of 1 and 16 MiB, in a fresh process: (served from the heap, heap not shrunk after its free)."""
    done = subprocess.run([sys.executable, "-c", PROBE, arm], capture_output=True, text=True, check=True)
    return done.stdout.split("\n")[:2]


def test_blocks_of_a_step_come_from_the_heap_and_stay_there_once_freed():
    assert where_blocks_go("kept") == ["True True", "True True"]


def test_with_glibcs_defaults_the_same_blocks_are_mmapped_afresh():
    """The control: without keep_freed_memory each block is a new mapping, faulted in page by page."""
    assert where_blocks_go("default") == ["False True", "False True"]


def test_another_c_library_is_left_alone(monkeypatch):
    monkeypatch.setattr(allocator, "is_glibc", lambda: False)
    assert allocator.keep_freed_memory.__wrapped__() is False
