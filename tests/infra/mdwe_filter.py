"""systemd's ``MemoryDenyWriteExecute=yes`` without systemd: the same seccomp filter, loaded with
libseccomp through ctypes, then the command exec'd under it (a filter is kept across exec and
inherited by every child, as in a unit).

systemd 252 (src/shared/seccomp-util.c) answers EPERM to ``mmap`` asking for PROT_WRITE and
PROT_EXEC at once, to ``mprotect``/``pkey_mprotect`` adding PROT_EXEC, and to ``shmat`` with
SHM_EXEC. These machines run no systemd as PID 1, so this is how infra/systemd's choice of which
units get it is tested (tests/infra/test_mdwe_tolerance.py).

    python -m tests.infra.mdwe_filter COMMAND [ARG...]
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys

SHM_EXEC = 0o100000
_ALLOW = 0x7FFF0000
_ERRNO_EPERM = 0x00050000 | errno.EPERM
_MASKED_EQ = 7  # SCMP_CMP_MASKED_EQ: (argument & mask) == value
_W, _X = mmap.PROT_WRITE, mmap.PROT_EXEC
# (system call, mask of its third argument, the value that is refused)
RULES = (
    ("mmap", _W | _X, _W | _X),
    ("mprotect", _X, _X),
    ("pkey_mprotect", _X, _X),
    ("shmat", SHM_EXEC, SHM_EXEC),
)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("mask", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
    ]


def install() -> None:
    """Load the filter into this process (and so into whatever it execs or starts)."""
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    ]  # fmt: skip
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    for name, mask, value in RULES:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        compare = (_ArgCmp * 1)(_ArgCmp(2, _MASKED_EQ, mask, value))
        if lib.seccomp_rule_add_array(ctx, _ERRNO_EPERM, number, 1, compare) != 0:
            raise OSError(f"seccomp_rule_add {name} failed")
    if lib.seccomp_load(ctx) != 0:
        raise OSError("seccomp_load failed")


if __name__ == "__main__":
    install()
    os.execvp(sys.argv[1], sys.argv[1:])
