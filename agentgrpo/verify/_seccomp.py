"""A seccomp deny-list for sandboxed jobs, as a classic BPF program built by hand.

Built here, not with libseccomp, to keep the sandbox free of a native dependency; the same bytes
serve the fork server (`prctl`) and bubblewrap (`bwrap --seccomp FD`). A deny-list on top of
namespaces, a non-root uid and `no_new_privs`: a foreign architecture or ABI kills the process;
syscalls that reach kernel attack surface or other processes (ptrace, mount, unshare, bpf,
io_uring, keyrings, ...) fail with EPERM, as do `clone` with CLONE_NEW* flags and terminal
keystroke injection; `clone3` fails with ENOSYS; sockets are unix, inet and inet6 only.
docs/sandbox.md ("Inside the local backends") lists the policy in full.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

# BPF opcodes (linux/filter.h)
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

_RET_KILL_PROCESS = 0x80000000
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000

# offsets into struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6];}
_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARG0_LO = 16
_OFF_ARG1_LO = 24

# All CLONE_NEW* flags that fit `clone`'s flags word: NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER,
# NEWPID, NEWNET. (CLONE_NEWTIME = 0x80 collides with the exit-signal byte of `clone`.)
_CLONE_NS_MASK = (
    0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
)
_ALLOWED_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
_DENIED_IOCTLS = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX

_DENY_NAMES = (
    "ptrace process_vm_readv process_vm_writev pidfd_getfd kcmp kexec_load kexec_file_load "
    "init_module finit_module delete_module mount umount2 pivot_root chroot unshare setns "
    "fsopen fsconfig fsmount fspick move_mount open_tree mount_setattr swapon swapoff reboot "
    "bpf perf_event_open userfaultfd keyctl add_key request_key open_by_handle_at "
    "name_to_handle_at lookup_dcookie acct quotactl quotactl_fd syslog settimeofday "
    "clock_settime clock_adjtime adjtimex vhangup fanotify_init io_uring_setup io_uring_enter "
    "io_uring_register nfsservctl iopl ioperm uselib"
).split()

# Syscall numbers from the kernel's uapi headers (asm/unistd_64.h, asm-generic/unistd.h).
_X86_64 = {
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "pidfd_getfd": 438,
    "kcmp": 312,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "chroot": 161,
    "unshare": 272,
    "setns": 308,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "move_mount": 429,
    "open_tree": 428,
    "mount_setattr": 442,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "bpf": 321,
    "perf_event_open": 298,
    "userfaultfd": 323,
    "keyctl": 250,
    "add_key": 248,
    "request_key": 249,
    "open_by_handle_at": 304,
    "name_to_handle_at": 303,
    "lookup_dcookie": 212,
    "acct": 163,
    "quotactl": 179,
    "quotactl_fd": 443,
    "syslog": 103,
    "settimeofday": 164,
    "clock_settime": 227,
    "clock_adjtime": 305,
    "adjtimex": 159,
    "vhangup": 153,
    "fanotify_init": 300,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "nfsservctl": 180,
    "iopl": 172,
    "ioperm": 173,
    "uselib": 134,
    "clone": 56,
    "clone3": 435,
    "socket": 41,
    "socketpair": 53,
    "ioctl": 16,
}
_AARCH64 = {
    "ptrace": 117,
    "process_vm_readv": 270,
    "process_vm_writev": 271,
    "pidfd_getfd": 438,
    "kcmp": 272,
    "kexec_load": 104,
    "kexec_file_load": 294,
    "init_module": 105,
    "finit_module": 273,
    "delete_module": 106,
    "mount": 40,
    "umount2": 39,
    "pivot_root": 41,
    "chroot": 51,
    "unshare": 97,
    "setns": 268,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "move_mount": 429,
    "open_tree": 428,
    "mount_setattr": 442,
    "swapon": 224,
    "swapoff": 225,
    "reboot": 142,
    "bpf": 280,
    "perf_event_open": 241,
    "userfaultfd": 282,
    "keyctl": 219,
    "add_key": 217,
    "request_key": 218,
    "open_by_handle_at": 265,
    "name_to_handle_at": 264,
    "lookup_dcookie": 18,
    "acct": 89,
    "quotactl": 60,
    "quotactl_fd": 443,
    "syslog": 116,
    "settimeofday": 170,
    "clock_settime": 112,
    "clock_adjtime": 266,
    "adjtimex": 171,
    "vhangup": 58,
    "fanotify_init": 262,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "nfsservctl": 42,
    "clone": 220,
    "clone3": 435,
    "socket": 198,
    "socketpair": 199,
    "ioctl": 29,
}
_ARCHES = {
    "x86_64": (0xC000003E, _X86_64, 0x40000000),  # AUDIT_ARCH_X86_64, table, x32 syscall bit
    "aarch64": (0xC00000B7, _AARCH64, None),
}


def supported() -> bool:
    """True when this machine's architecture has a syscall table here."""
    return platform.machine() in _ARCHES


def build_filter(machine: str | None = None) -> bytes:
    """The deny-list as the raw bytes of a `struct sock_filter[]` (8 bytes per instruction)."""
    arch, table, x32_bit = _ARCHES[machine or platform.machine()]
    prog: list[tuple[int, int, int, int]] = []  # (code, jt, jf, k); jumps are relative

    def ins(code: int, k: int, jt: int = 0, jf: int = 0) -> None:
        prog.append((code, jt, jf, k))

    def ret_errno(err: int) -> None:
        ins(_RET_K, _RET_ERRNO | err)

    ins(_LD_W_ABS, _OFF_ARCH)
    ins(_JEQ_K, arch, jt=1)
    ins(_RET_K, _RET_KILL_PROCESS)
    ins(_LD_W_ABS, _OFF_NR)
    if x32_bit is not None:
        ins(_JGE_K, x32_bit, jf=1)
        ins(_RET_K, _RET_KILL_PROCESS)
    for name in _DENY_NAMES:
        if name in table:
            ins(_JEQ_K, table[name], jf=1)
            ret_errno(errno.EPERM)
    # clone: refuse namespace flags (arg0, low word)
    ins(_JEQ_K, table["clone"], jf=4)
    ins(_LD_W_ABS, _OFF_ARG0_LO)
    ins(_JSET_K, _CLONE_NS_MASK, jf=1)
    ret_errno(errno.EPERM)
    ins(_RET_K, _RET_ALLOW)
    ins(_JEQ_K, table["clone3"], jf=1)
    ret_errno(errno.ENOSYS)
    # socket/socketpair: address family allow-list (arg0)
    ins(_JEQ_K, table["socket"], jt=1)
    ins(_JEQ_K, table["socketpair"], jf=3 + len(_ALLOWED_FAMILIES))
    ins(_LD_W_ABS, _OFF_ARG0_LO)
    for i, fam in enumerate(_ALLOWED_FAMILIES):
        ins(_JEQ_K, fam, jt=len(_ALLOWED_FAMILIES) - i)
    ret_errno(errno.EAFNOSUPPORT)
    ins(_RET_K, _RET_ALLOW)
    # ioctl: the command is an unsigned int in the kernel, so the low word is exact (arg1)
    ins(_JEQ_K, table["ioctl"], jf=1 + 2 * len(_DENIED_IOCTLS))
    ins(_LD_W_ABS, _OFF_ARG1_LO)
    for cmd in _DENIED_IOCTLS:
        ins(_JEQ_K, cmd, jf=1)
        ret_errno(errno.EPERM)
    ins(_RET_K, _RET_ALLOW)
    if len(prog) > 4096:  # BPF_MAXINSNS
        raise AssertionError("seccomp filter too long")
    return b"".join(struct.pack("=HBBI", c, jt, jf, k) for c, jt, jf, k in prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


class Installer:
    """Holds a built filter in C memory so installing it after fork is a single `prctl` call."""

    def __init__(self, program: bytes | None = None) -> None:
        self._program = program if program is not None else build_filter()
        self._buf = ctypes.create_string_buffer(self._program, len(self._program))
        self._fprog = _SockFprog(len(self._program) // 8, ctypes.addressof(self._buf))
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.prctl.argtypes = [
            ctypes.c_int,
            ctypes.c_ulong,
            ctypes.c_ulong,
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]

    @property
    def program(self) -> bytes:
        return self._program

    def install(self) -> None:
        """Set no_new_privs and load the filter into the calling thread (inherited by children)."""
        if self._libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, "prctl(PR_SET_NO_NEW_PRIVS)")
        if (
            self._libc.prctl(
                PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(self._fprog), 0, 0
            )
            != 0
        ):
            err = ctypes.get_errno()
            raise OSError(err, "prctl(PR_SET_SECCOMP)")
