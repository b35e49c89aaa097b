"""Which platforms jax may start: the CPU alone on a machine with no accelerator.

Left to itself, jax tries every backend it knows the first time a device is asked for. On a
machine with no GPU or TPU that prints what looks like a failure: "Unable to initialize
backend 'tpu': ... libtpu.so" from a bare install, and with jax[cuda12] / jax[tpu] installed
(the test extra) a ten-line CUDA-plugin traceback and libtpu's warnings about TPU host
names. Nothing is wrong, the CPU runs the model, but a newcomer reads it as broken.

So, before the first device is touched, `restrict_to_present_hardware` looks for
accelerators the way the kernel shows them (PCI vendor and class ids under /sys, the device
nodes NVIDIA, AMD and TPU drivers make under /dev) and, if there are none, tells jax to use
its CPU backend only. A choice the user made (JAX_PLATFORMS, jax.config) is kept, and on a
machine with any accelerator jax probes as it always does.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

PCI_DEVICES = Path("/sys/bus/pci/devices")
# PCI vendor id -> what an accelerator of that vendor is called (jax's backends for them).
ACCELERATOR_VENDORS = {"0x10de": "NVIDIA GPU", "0x1002": "AMD GPU", "0x1ae0": "Google TPU"}
# PCI class ids (first byte) of display controllers and processing accelerators; NVIDIA and
# AMD also make network cards and bridges, which do not count.
ACCELERATOR_CLASSES = ("0x03", "0x12")
# Device nodes that accelerator drivers create (containers often see these, not the bus).
DEVICE_NODES = (
    ("/dev", re.compile(r"nvidia\d+$"), "NVIDIA GPU"),
    ("/dev", re.compile(r"kfd$"), "AMD GPU"),
    ("/dev", re.compile(r"accel\d+$"), "Google TPU"),
    ("/dev/vfio", re.compile(r"\d+$"), "VFIO device (TPU)"),
)


def present_accelerators(
    pci_devices: Path = PCI_DEVICES, device_nodes: tuple = DEVICE_NODES
) -> list[str]:
    """What this machine shows of GPUs and TPUs: one entry per device found (may repeat)."""
    found = []
    if pci_devices.is_dir():
        for device in pci_devices.iterdir():
            vendor = _read(device / "vendor")
            if vendor in ACCELERATOR_VENDORS and _read(device / "class").startswith(
                ACCELERATOR_CLASSES
            ):
                found.append(ACCELERATOR_VENDORS[vendor])
    for folder, pattern, name in device_nodes:
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        found.extend(name for entry in entries if pattern.match(entry))
    return found


def restrict_to_present_hardware() -> None:
    """Tell jax to start only its CPU backend when the machine has no accelerator (Linux,
    where /sys shows the hardware), unless the user already chose the platforms. A no-op
    once jax has started its backends."""
    chosen = jax.config.jax_platforms
    if chosen:
        logger.debug("jax platforms chosen by the user: %s", chosen)
        return
    if not sys.platform.startswith("linux"):
        return
    found = present_accelerators()
    if found:
        logger.debug("accelerators found (%s): jax probes its backends", ", ".join(set(found)))
        return
    logger.debug(
        "no GPU or TPU on the PCI bus or under /dev: jax starts its CPU backend only "
        "(set JAX_PLATFORMS to choose otherwise)"
    )
    jax.config.update("jax_platforms", "cpu")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
