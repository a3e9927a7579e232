"""GPU types: memory, HBM bandwidth, dense bf16 TFLOP/s, intra-node link and network."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from coral_dagster import paths
from coral_dagster.catalog._load import check_unique, field, read_yaml, rows_of
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.errors import CatalogError, UnknownNameError

GIB = 1024**3


@dataclass(frozen=True)
class GpuType:
    """One GPU model as SkyPilot names it."""

    name: str
    mem_gib: float
    hbm_gb_s: float
    bf16_tflops: float
    dtype: str
    link: str
    intra_node_gb_s: float
    nic_gbps_per_gpu: float


@dataclass(frozen=True)
class NodeSpec:
    """A node configuration with the facts of its GPU type resolved."""

    config: NodeConfig
    gpu: GpuType

    @property
    def mem_bytes(self) -> float:
        return self.gpu.mem_gib * GIB * self.config.count

    @property
    def nic_gbps(self) -> float:
        return self.gpu.nic_gbps_per_gpu * self.config.count

    def __str__(self) -> str:
        return str(self.config)


def load_gpus(path: Path | None = None) -> dict[str, GpuType]:
    """Read and validate `gpus.yaml`."""
    path = Path(path or paths.CATALOG_DIR / "gpus.yaml")
    rows = rows_of(read_yaml(path), "gpus", path)
    gpus = []
    for i, r in enumerate(rows):
        dtype = field(r, "dtype", str, path, i)
        if dtype not in ("bfloat16", "float16"):
            raise CatalogError(path, i, "dtype", f"{dtype!r} is not a GPU compute dtype", "use bfloat16 or float16")
        gpus.append(GpuType(
            name=field(r, "name", str, path, i),
            mem_gib=field(r, "mem_gib", float, path, i, positive=True),
            hbm_gb_s=field(r, "hbm_gb_s", float, path, i, positive=True),
            bf16_tflops=field(r, "bf16_tflops", float, path, i, positive=True),
            dtype=dtype,
            link=field(r, "link", str, path, i),
            intra_node_gb_s=field(r, "intra_node_gb_s", float, path, i, positive=True),
            nic_gbps_per_gpu=field(r, "nic_gbps_per_gpu", float, path, i, positive=True),
        ))
    check_unique([g.name for g in gpus], path, "name")
    return {g.name: g for g in gpus}


@lru_cache(maxsize=None)
def gpu_catalog() -> dict[str, GpuType]:
    """The bundled GPU catalog, read once."""
    return load_gpus()


def get_gpu(name: str) -> GpuType:
    """A GPU type by name; unknown names list the valid ones."""
    gpus = gpu_catalog()
    if name not in gpus:
        raise UnknownNameError("GPU", name, list(gpus))
    return gpus[name]


def node_spec(node: NodeConfig | str) -> NodeSpec:
    """Resolve `L40S:2` (or a `NodeConfig`) against the GPU catalog."""
    config = NodeConfig.parse(node) if isinstance(node, str) else node
    return NodeSpec(config, get_gpu(config.gpu))
