"""The host's GPUs and what each needs done to a container to be used in it.

Two sources, the first that names a GPU wins:
1. **CDI specs** of kind ``EngineConfig.gpu_cdi_kind`` (``nvidia-ctk cdi generate`` writes one naming
   each GPU by index and by UUID, plus ``all``): each GPU's edits and the spec's common ones, as they are.
2. **Discovery**: the ``nvidia<N>`` device nodes in ``gpu_dev_dir``, the nodes every GPU needs
   (``nvidiactl``, ``nvidia-uvm``, ``nvidia-uvm-tools``, ``nvidia-modeset``, ``nvidia-caps/*``), each
   GPU's UUID and model from the driver's /proc files, and the driver's files: a ``gpu_driver_dirs``
   tree bound read-only with its ``lib64`` and ``bin`` put on the paths, else the driver libraries
   ``ldconfig`` knows and ``nvidia-smi``, each bound where it is.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import cdi
from .cdi import DeviceNode, Edits, Mount

GPU_NODE = re.compile(r"^nvidia(\d+)$")
SHARED_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
DRIVER_LIBS = ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so", "libnvidia-nvvm.so",
               "libcudadebugger.so", "libnvidia-gpucomp.so", "libnvidia-allocator.so", "libnvidia-cfg.so")
DRIVER_TOOLS = ("nvidia-smi", "nvidia-debugdump", "cuda-checkpoint")
PATH_LIKE = ("PATH", "LD_LIBRARY_PATH")
"""Variables a GPU edit puts in front of the image's value rather than replacing it."""


@dataclass(frozen=True)
class Gpu:
    """One GPU of the host."""

    id: str
    """Its UUID (``GPU-...``), or its index where the host tells none."""
    index: int
    names: tuple[str, ...]
    """Every name that picks it: its index, UUID and CDI device names."""
    model: str
    edits: Edits


@dataclass(frozen=True)
class GpuHost:
    """What the host has: its GPUs, the edits every GPU sandbox needs, and where it was all found."""

    gpus: tuple[Gpu, ...]
    common: Edits
    source: str
    """``cdi PATH`` or ``discovered in DIR``, or what was looked for where none was found."""

    def find(self, name: str) -> Gpu | None:
        return next((gpu for gpu in self.gpus if name in gpu.names), None)

    def edits(self, ids: list[str] | tuple[str, ...]) -> Edits:
        """The edits that give a sandbox the GPUs ``ids`` (``Gpu.id``s)."""
        out = self.common
        for gpu in self.gpus:
            if gpu.id in ids:
                out = out + gpu.edits
        return out


def discover(*, cdi_dirs: tuple[str, ...], cdi_kind: str, dev_dir: str, proc_dir: str,
             driver_dirs: tuple[str, ...]) -> GpuHost:
    """The host's GPUs as the CDI specs say, else as its device nodes and driver files show."""
    uuids = _proc_info(Path(proc_dir))
    specs = [spec for spec in cdi.load_specs(cdi_dirs) if spec.kind == cdi_kind]
    for spec in specs:
        gpus = _from_spec(spec, uuids)
        if gpus:
            return GpuHost(gpus, spec.common, f"cdi {spec.path}")
    gpus, common = _from_nodes(Path(dev_dir), uuids)
    if not gpus:
        where = ", ".join(cdi_dirs)
        return GpuHost((), Edits(), f"no CDI spec of kind {cdi_kind} in {where}, and no {dev_dir}/nvidia<N> device node")
    return GpuHost(gpus, common + _driver(driver_dirs), f"discovered in {dev_dir}")


def _from_spec(spec: cdi.Spec, uuids: dict[int, tuple[str, str]]) -> tuple[Gpu, ...]:
    """The spec's GPUs: its devices but ``all``, those whose nodes are the same GPU's taken as one."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, edits in spec.devices.items():
        if name == "all":
            continue
        key = tuple(sorted(node.path for node in edits.nodes if GPU_NODE.match(Path(node.path).name))) or (name,)
        groups.setdefault(key, []).append(name)
    gpus = []
    for position, (key, names) in enumerate(groups.items()):
        edits = Edits()
        for name in names:
            edits = edits + spec.devices[name]
        # /dev/nvidia<N> is the GPU of minor number N, as the driver's /proc files name it
        minor = next((int(GPU_NODE.match(Path(path).name).group(1)) for path in key if path.startswith("/dev/")), None)
        uuid, model = uuids.get(minor, ("", "")) if minor is not None else ("", "")
        index = next((int(name) for name in names if name.isdigit()), minor if minor is not None else position)
        uuid = uuid or next((name for name in names if name.startswith(("GPU-", "MIG-"))), "")
        all_names = tuple(dict.fromkeys([str(index), *([uuid] if uuid else []), *names]))
        gpus.append(Gpu(uuid or str(index), index, all_names, model or spec.kind, edits))
    return tuple(sorted(gpus, key=lambda gpu: gpu.index))


def _from_nodes(dev: Path, uuids: dict[int, tuple[str, str]]) -> tuple[tuple[Gpu, ...], Edits]:
    if not dev.is_dir():
        return (), Edits()
    gpus = []
    for path in sorted(dev.iterdir(), key=lambda p: p.name):
        found = GPU_NODE.match(path.name)
        if found is None:
            continue
        node = _device(path, f"/dev/{path.name}")
        if node is None:
            continue
        index = int(found.group(1))
        uuid, model = uuids.get(index, ("", ""))  # nvidia<N> has minor number N
        names = (str(index), uuid) if uuid else (str(index),)
        gpus.append(Gpu(uuid or str(index), index, names, model or "NVIDIA GPU", Edits(nodes=(node,))))
    shared = [_device(dev / name, f"/dev/{name}") for name in SHARED_NODES]
    caps = dev / "nvidia-caps"
    if caps.is_dir():
        shared += [_device(path, f"/dev/nvidia-caps/{path.name}") for path in sorted(caps.iterdir())]
    return tuple(gpus), Edits(nodes=tuple(node for node in shared if node is not None))


def _device(path: Path, inside: str) -> DeviceNode | None:
    try:
        kind, major, minor = cdi.node_numbers(str(path))
    except ValueError:
        return None
    return DeviceNode(inside, str(path), kind, major, minor)


def _proc_info(proc: Path) -> dict[int, tuple[str, str]]:
    """Minor number -> (UUID, model), from the driver's ``gpus/<bus id>/information`` files."""
    found: dict[int, tuple[str, str]] = {}
    gpus = proc / "gpus"
    if not gpus.is_dir():
        return found
    for info in sorted(gpus.glob("*/information")):
        fields = {}
        try:
            for line in info.read_text().splitlines():
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
            found[int(fields["Device Minor"])] = (fields.get("GPU UUID", ""), fields.get("Model", ""))
        except (OSError, KeyError, ValueError):
            continue
    return found


def _driver(driver_dirs: tuple[str, ...]) -> Edits:
    """The driver's libraries and tools: a driver tree where there is one, else each file where it lies."""
    for directory in driver_dirs:
        root = Path(directory)
        if not root.is_dir():
            continue
        libs = [str(root / sub) for sub in ("lib64", "lib") if (root / sub).is_dir()]
        env = [f"LD_LIBRARY_PATH={':'.join(libs)}"] if libs else []
        if (root / "bin").is_dir():
            env.append(f"PATH={root / 'bin'}")
        return Edits(mounts=(Mount(str(root), str(root)),), env=tuple(env))
    files = _ldconfig_libs() + [path for tool in DRIVER_TOOLS if (path := shutil.which(tool))]
    return Edits(mounts=tuple(Mount(path, path) for path in dict.fromkeys(files)))


def _ldconfig_libs() -> list[str]:
    """The driver's libraries the host's linker cache knows: each name, and the file it links to."""
    try:
        listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for line in listed.splitlines():
        name, _, path = line.strip().partition(" => ")
        if path and name.startswith(DRIVER_LIBS) and Path(path).exists():
            found += [path, str(Path(path).resolve())]
    return found


def merged_env(edits: Edits, image_env: dict[str, str], default_path: str) -> dict[str, str]:
    """The edits' variables as a command gets them: PATH and LD_LIBRARY_PATH go before the image's value."""
    out = {}
    for key, value in edits.env_dict().items():
        if key in PATH_LIKE:
            before = image_env.get(key, default_path if key == "PATH" else "")
            value = f"{value}:{before}" if before else value
        out[key] = value
    return out

