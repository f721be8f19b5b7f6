"""Host (CPU) memory that glibc keeps after ``free``: three remedies for stage 3 on CPU.

0. ``host_buffer``: the gather and bucket pools' buffers live outside the heap, Note [own mappings].
1. ``trim_host_heap`` (on by default for stage 3 on CPU): one ``malloc_trim`` every
   ``ZERORUN_HOST_TRIM`` optimizer steps (default ``DEFAULT_TRIM_INTERVAL``, 0 turns it off),
   Note [trim after step] below.
2. ``return_large_frees_to_os`` (opt-in, ZERORUN_HOST_MALLOC_TUNING=<MiB>), described here:

Stage 3 saves memory by gathering a unit's parameters just before use and freeing them right
after. glibc defeats that on the host: after the first large free it raises its mmap threshold
(up to 32 MiB), so later gathered units and gradient buckets come from the heap, and freed heap
memory in the middle stays resident. Measured on the 33.7M GPT of GUIDE §5 (2 CPU ranks):
peak RSS 995 -> 846 MiB per rank with a fixed 1 MiB threshold. Fixing the threshold (and so
disabling the dynamic raise) returns every buffer above it to the OS when freed.

The price is a page fault on every large allocation: step time went 1.05x -> 1.35x DDP's
there (an 8 MiB threshold: 0.84x RSS, 1.07x time). So it is opt-in: set
ZERORUN_HOST_MALLOC_TUNING to the threshold in MiB (1 to 32; 0 or unset: off) when host memory,
not time, is the limit. Measured again after issue 20 (scripts/bench_cpu.py --repeats 2
--systems ddp,zero3, stage 3 against DDP): 4 MiB gave 0.74x peak RSS at 1.08x wall / 1.05x CPU
time, against 0.80x at 1.00x / 0.98x without it; since own mappings (0.) the default is
0.73-0.74x at the same CPU time as before. A no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from _ctypes import CFuncPtr

import torch

M_MMAP_THRESHOLD = -3  # from glibc's malloc.h
MAX_THRESHOLD_MIB = 32  # glibc's own ceiling for the dynamic threshold on 64-bit hosts

_applied = False


def _libc(symbol: str) -> CFuncPtr | None:
    """The C library's ``symbol`` (a ctypes function), or None off glibc."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), symbol) if name else None
    except (OSError, AttributeError):
        return None


def return_large_frees_to_os() -> bool:
    """Returns True when the threshold was set (once per process)."""
    global _applied
    threshold_mib = malloc_tuning_mib(os.environ)
    if _applied or threshold_mib == 0:
        return _applied
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = mallopt(M_MMAP_THRESHOLD, threshold_mib << 20) == 1
    return _applied


def malloc_tuning_mib(environ) -> int:
    """The fixed mmap threshold in MiB from ``ZERORUN_HOST_MALLOC_TUNING`` (0: leave glibc's)."""
    raw = environ.get("ZERORUN_HOST_MALLOC_TUNING", "0").strip()
    if not raw.isdigit() or int(raw) > MAX_THRESHOLD_MIB:
        from zerorun.errors import RuntimeConfigError

        raise RuntimeConfigError(f"ZERORUN_HOST_MALLOC_TUNING is {raw!r}; it must be a threshold in MiB from 1 to "
                                 f"{MAX_THRESHOLD_MIB} (0 or unset: off)")
    return int(raw)


HUGE_PAGE_BYTES = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels
OWN_MAPPING_MIN_BYTES = 8 << 20  # Note [own mappings]: smaller pool buffers stay in the heap

_trim_probed = False
_libc_trim: CFuncPtr | None = None  # glibc's malloc_trim, once probed; stays None off glibc
DEFAULT_TRIM_INTERVAL = 4


def trim_interval(environ) -> int:
    """Optimizer steps between heap trims, from ``ZERORUN_HOST_TRIM`` (0: never)."""
    raw = environ.get("ZERORUN_HOST_TRIM", str(DEFAULT_TRIM_INTERVAL)).strip()
    if not raw.isdigit():
        from zerorun.errors import RuntimeConfigError

        raise RuntimeConfigError(f"ZERORUN_HOST_TRIM is {raw!r}; it must be a whole number of steps (0 turns trimming off)")
    return int(raw)


def trim_host_heap() -> bool:
    """Give the host heap's free pages back to the OS (glibc ``malloc_trim``); False off glibc.

    Note [trim after step]: between steps a stage-3 rank on CPU holds its shards and little
    else, but glibc keeps every page that backward's activations, gathered units and buckets
    ever touched: measured on the 33.7M GPT, 846 MiB resident after a step of which 268 MiB
    were free heap. Trimming after an optimizer step, when live memory is lowest, returns
    them; but the next step faults most of them back in (2-3 us per 4 KiB page on the 2-core
    VM: ~60k faults, 5-6% of the 33.7M GPT's step). Without any trim, fragmentation creeps up
    step after step. Measured with scripts/bench_cpu.py, stage 3 against DDP, once stage 3's
    gradient shards lived only from backward to the step (Note [lazy gradient shards] in
    grad_reduce.py): a trim every step, 1.04x wall and 0.77x peak RSS; every 4 steps (the
    default), 0.99x wall and 0.77x RSS; never (a profiling run), 911-922 MiB, about 0.80x. ZERORUN_HOST_TRIM=N picks the
    trade (1 when resident memory is all that matters).
    """
    global _libc_trim, _trim_probed
    if not _trim_probed:
        _trim_probed = True
        _libc_trim = _libc("malloc_trim")
        if _libc_trim is not None:
            _libc_trim.argtypes = [ctypes.c_size_t]
            _libc_trim.restype = ctypes.c_int
    if _libc_trim is None:
        return False
    _libc_trim(0)
    return True


def host_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes``: at or above ``OWN_MAPPING_MIN_BYTES`` in an anonymous
    mapping of its own (Note [own mappings]), below it (or where Python's mmap cannot advise
    huge pages) a plain ``torch.empty`` from the heap.

    Note [own mappings]: the stage-3 gather pool and the reducer's bucket pool hold buffers for
    a step or less. In glibc's heap a dropped buffer stays resident (it is freed in the middle
    of the heap, among live activations), so dropping idle pool buffers early gained nothing.
    In a mapping of its own the memory goes back to the OS the moment the buffer dies, so the
    pools can give memory back as soon as the pass has no more use for it (Note [pools follow
    backward] in unit/storage.py and grad_reduce.py), before the loss's logits or the
    embedding's dense gradient come on top: stage 3's peak RSS on the 33.7M GPT went from 0.80x
    to 0.74x DDP's. The price is that a fresh mapping faults in on first touch, where a heap
    chunk freed and taken again does not: 2-3 us per 4 KiB page on the 2-core VM. So the mapping
    is advised for transparent huge pages (honoured in the kernel's "madvise" and "always"
    modes) and starts on a 2 MiB boundary, so each whole 2 MiB of it faults in at once: 12.6 MB
    mapped and filled in 1.7 ms against 5.6 ms unaligned, where glibc's own mapping of a 32 MiB
    buffer took 9.5 ms. Small buffers stay in the heap: with 3.5 MB buffers (the 12.3M bf16 GPT
    of scripts/bench_memory.py) own mappings cost 6% of stage 3's step for no peak gain.
    """
    if nbytes < OWN_MAPPING_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    # The tensor holds ``mapping``; it is unmapped when the last storage using it dies. The
    # slack before the aligned start and after the end is never touched, so never resident.
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=-start % HUGE_PAGE_BYTES)
