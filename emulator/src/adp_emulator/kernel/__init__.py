"""Kernel nvmet backend: host nvmet via configfs/nvmetcli, or nvmet in a QEMU guest built from Debian packages.

See docs/kernel-backend.md.
"""

from adp_emulator.kernel.configfs import Op, apply, plan, remove, to_shell, undo_plan
from adp_emulator.kernel.image import GuestImage, build_guest_image, resolve_kernel_package
from adp_emulator.kernel.initiator import GuestResult, make_pattern, run_guest_initiator
from adp_emulator.kernel.probe import build_icreq, icreq_exchange, parse_icresp, wait_icresp
from adp_emulator.kernel.target import KernelTarget, guest_config, host_nvmet_status
from adp_emulator.kernel.tools import KernelBackendError, MissingDependencyError, cache_root, require_tools
from adp_emulator.kernel.vm import QemuVM, choose_accel, probe_kvm

__all__ = [
    "GuestImage", "GuestResult", "KernelBackendError", "KernelTarget", "MissingDependencyError", "Op", "QemuVM",
    "apply", "build_guest_image", "build_icreq", "cache_root", "choose_accel", "guest_config",
    "host_nvmet_status", "icreq_exchange", "make_pattern", "parse_icresp", "plan", "probe_kvm", "remove",
    "require_tools", "resolve_kernel_package", "run_guest_initiator", "to_shell", "undo_plan", "wait_icresp",
]
