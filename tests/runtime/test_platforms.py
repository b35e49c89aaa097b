"""Which platforms jax may start: the CPU alone where the machine shows no accelerator, so a
default run prints none of jax's failed probes (libtpu, the CUDA plugin's traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import ONE_BUCKET_GENERATE, run_script

from jaxcb.runtime import platforms


def _pci_device(root: Path, name: str, vendor: str, device_class: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "vendor").write_text(vendor + "\n")
    (root / name / "class").write_text(device_class + "\n")


def test_accelerators_are_found_on_the_pci_bus_and_under_dev(tmp_path):
    pci = tmp_path / "pci"
    _pci_device(pci, "0000:00:01.0", "0x1af4", "0x010000")  # virtio disk
    _pci_device(pci, "0000:00:02.0", "0x10de", "0x020000")  # an NVIDIA network card
    none = (str(tmp_path / "no-dev"), platforms.DEVICE_NODES[0][1], "NVIDIA GPU")
    assert platforms.present_accelerators(pci, (none,)) == []

    _pci_device(pci, "0000:00:03.0", "0x10de", "0x030200")  # an NVIDIA 3D controller
    _pci_device(pci, "0000:00:04.0", "0x1ae0", "0x120000")  # a Google TPU
    assert sorted(platforms.present_accelerators(pci, (none,))) == ["Google TPU", "NVIDIA GPU"]

    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").touch()
    (dev / "nvidiactl").touch()  # the control node is not a GPU
    nodes = ((str(dev), platforms.DEVICE_NODES[0][1], "NVIDIA GPU"),)
    assert platforms.present_accelerators(tmp_path / "no-bus", nodes) == ["NVIDIA GPU"]


def _platforms_after(env: dict[str, str], present: list[str]) -> str:
    code = (
        "import jax; from jaxcb.runtime import platforms; "
        f"platforms.present_accelerators = lambda: {present!r}; "
        "platforms.restrict_to_present_hardware(); print(jax.config.jax_platforms)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_the_cpu_alone_without_accelerators_and_the_user_s_choice_kept():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    assert _platforms_after(env, []) == "cpu"
    assert _platforms_after(env, ["NVIDIA GPU"]) in ("", "None")  # jax probes as it would
    assert _platforms_after(dict(env, JAX_PLATFORMS="cpu,tpu"), []) == "cpu,tpu"


def test_a_default_run_prints_no_failed_probe():
    """generate.py with JAX_PLATFORMS unset, in the test venv (jax[cuda12] and jax[tpu]
    installed, no GPU or TPU here): no traceback, no backend that failed to start."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    result = run_script("generate", ["Hi", *ONE_BUCKET_GENERATE], env)
    assert result.returncode == 0, result.stderr[-3000:]
    for noise in ("Traceback", "Unable to initialize backend", "libtpu", "CUDA", "PyTorch"):
        assert noise not in result.stderr, result.stderr[-3000:]
    assert "completion:" in result.stdout
