"""Hardware catalogue: peak FLOP/s per dtype, memory capacity and bandwidth, on-chip memory, interconnect.

Every number carries the URL it was taken from (``HardwareSpec.sources``, keyed by field name;
``peak.<dtype>`` for a peak). Peaks are **dense** (no 2:4 sparsity); vendors that headline
sparse figures are halved here and the sparse figure is kept apart in ``sparse_peak_flops``.
Integer peaks are in OP/s and stored under the same dict (``int8``).

Units: FLOP/s, bytes, bytes/s (decimal: 1 TB/s = 1e12 B/s). ``interconnect_bandwidth`` is the
vendor's per-chip *bidirectional* figure (NVLink 900 GB/s, ICI 1200 GB/s); the roofline uses half
of it, the per-direction bandwidth, as the ring all-reduce bus bandwidth. ``interconnect_latency`` is the
fixed cost of one hop of a ring collective (link latency + the library's per-call overhead); the catalogue leaves
it unknown (0 in the roofline) unless measured — ``bytediet roofline --link-latency-us`` sets it, and
``bench/tp_step_time.py`` measures it for processes on this machine.

A new device is one more ``@HARDWARE.register("id")`` factory below; ``this-machine`` is measured
(:mod:`bytediet.perf.measure`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from ..errors import ConfigError
from ..registry import Registry

T, G, M = 1e12, 1e9, 1e6

# When a device has no unit for the requested compute dtype, fall back to the next wider one
# (e.g. fp4 weights run through fp8 units, fp8 through bf16): never to a narrower, faster one.
_FALLBACK = {"fp4": "fp8", "fp8": "bf16", "int8": "bf16", "bf16": "fp16", "fp16": "bf16", "tf32": "fp32"}
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8", "fp4")


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator chip (``chips`` > 1 only for a fixed multi-chip product)."""

    id: str
    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: float
    memory_bandwidth: float
    interconnect_bandwidth: Optional[float] = None
    interconnect_latency: Optional[float] = None  # seconds per hop of a ring collective, whatever its size
    onchip_bytes: Optional[float] = None
    onchip_bandwidth: Optional[float] = None
    chips: int = 1
    sparse_peak_flops: Mapping[str, float] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""
    measured: bool = False
    compute_dtype_default: Optional[str] = None  # what the engine computes in here (None: bf16; fp32 on measured CPUs)

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0:
            raise ConfigError(f"hardware {self.id}: memory size and bandwidth must be positive")
        unknown = set(self.peak_flops) - set(DTYPES)
        if unknown:
            raise ConfigError(f"hardware {self.id}: unknown dtypes {sorted(unknown)}; use {DTYPES}")
        if not self.peak_flops:
            raise ConfigError(f"hardware {self.id}: needs at least one peak FLOP/s figure")

    def compute_dtype(self, dtype: str) -> str:
        """The dtype whose units actually run ``dtype`` on this chip (itself, or a wider fallback)."""
        seen = []
        d = dtype.lower()
        while d not in self.peak_flops:
            seen.append(d)
            d = _FALLBACK.get(d, "fp32")
            if d in seen:
                break
        if d not in self.peak_flops:
            d = max(self.peak_flops, key=self.peak_flops.get)
        return d

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s (OP/s for int8) for ``dtype``, after the fallback of :meth:`compute_dtype`."""
        return self.peak_flops[self.compute_dtype(dtype)]

    def ridge_point(self, dtype: str) -> float:
        """Arithmetic intensity (FLOP/byte) above which an operator is compute-bound."""
        return self.peak(dtype) / self.memory_bandwidth

    @property
    def link_bandwidth(self) -> Optional[float]:
        """Per-direction interconnect bandwidth (B/s) used as the ring all-reduce bus bandwidth."""
        return None if self.interconnect_bandwidth is None else self.interconnect_bandwidth / 2

    def chips_to_hold(self, nbytes: float) -> int:
        """How many chips' memory are needed to hold ``nbytes`` (weights + KV), at least 1."""
        return max(1, math.ceil(nbytes / self.memory_bytes))

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "sparse_peak_flops": dict(self.sparse_peak_flops),
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "interconnect_bandwidth": self.interconnect_bandwidth,
            "interconnect_latency": self.interconnect_latency,
            "onchip_bytes": self.onchip_bytes,
            "onchip_bandwidth": self.onchip_bandwidth,
            "chips": self.chips,
            "measured": self.measured,
            "notes": self.notes,
            "sources": dict(self.sources),
        }


HARDWARE: Registry[Callable[[], HardwareSpec]] = Registry("hardware")


def get_hardware(name: str) -> HardwareSpec:
    """Build a catalogue entry by id (``h100-sxm``, ``tpu-v7``, ``this-machine`` …)."""
    return HARDWARE.get(name.strip())()


def _sources(default: str, peak: str, **extra: str) -> dict[str, str]:
    """Source URL per field: ``default`` for the memory/interconnect figures unless ``extra`` overrides one."""
    keys = ["memory_bytes", "memory_bandwidth", "interconnect_bandwidth", "onchip_bytes", "onchip_bandwidth"]
    out = {k: default for k in keys}
    out.update(peak_flops=peak, **extra)
    return out


# ---------------------------------------------------------------- NVIDIA
_H100_URL = "https://www.nvidia.com/en-us/data-center/h100/"
_H100_PEAKS = {
    "fp32": 67 * T,
    "tf32": 494.7 * T,
    "bf16": 989.4 * T,
    "fp16": 989.4 * T,
    "fp8": 1978.9 * T,
    "int8": 1978.9 * T,
}
_H100_SPARSE = {"tf32": 989.4 * T, "bf16": 1978.9 * T, "fp16": 1978.9 * T, "fp8": 3957.8 * T, "int8": 3957.8 * T}


@HARDWARE.register("h100-sxm")
def h100_sxm() -> HardwareSpec:
    return HardwareSpec(
        id="h100-sxm",
        name="NVIDIA H100 SXM5 80GB",
        peak_flops=_H100_PEAKS,
        sparse_peak_flops=_H100_SPARSE,
        memory_bytes=80 * G,
        memory_bandwidth=3.35 * T,
        interconnect_bandwidth=900 * G,
        onchip_bytes=50 * M,  # L2; plus up to 228 KB shared memory per SM x 132 SMs
        sources=_sources(
            _H100_URL,
            peak=_H100_URL + " (datasheet lists sparse figures; dense = 1/2)",
            onchip_bytes="https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html (NVIDIA table: 50 MB L2)",
        ),
        notes="Datasheet tensor figures are 'with sparsity'; stored dense values are half of them.",
    )


@HARDWARE.register("h200")
def h200() -> HardwareSpec:
    url = "https://www.nvidia.com/en-us/data-center/h200/"
    return HardwareSpec(
        id="h200",
        name="NVIDIA H200 SXM 141GB",
        peak_flops=_H100_PEAKS,
        sparse_peak_flops=_H100_SPARSE,
        memory_bytes=141 * G,
        memory_bandwidth=4.8 * T,
        interconnect_bandwidth=900 * G,
        onchip_bytes=50 * M,
        sources=_sources(
            url,
            peak=url + " (same GH100 compute as H100 SXM; sparse figures halved); cross-check "
            "https://lzwjava.github.io/nvidia-h200-gpu-specs-en",
            onchip_bytes=_H100_URL + " (same die as H100: 50 MB L2)",
        ),
        notes="Same die and peaks as H100 SXM; more and faster HBM3e.",
    )


@HARDWARE.register("b200")
def b200() -> HardwareSpec:
    url = "https://www.nvidia.com/en-us/data-center/hgx/"
    return HardwareSpec(
        id="b200",
        name="NVIDIA B200 (HGX, 1000 W)",
        peak_flops={
            "fp32": 75 * T,
            "tf32": 1.1e15,
            "bf16": 2.25e15,
            "fp16": 2.25e15,
            "fp8": 4.5e15,
            "int8": 4.5e15,
            "fp4": 9e15,
        },
        sparse_peak_flops={"tf32": 2.2e15, "bf16": 4.5e15, "fp16": 4.5e15, "fp8": 9e15, "int8": 9e15, "fp4": 18e15},
        memory_bytes=180 * G,
        memory_bandwidth=7.7 * T,
        interconnect_bandwidth=1.8 * T,
        sources=_sources(
            url,
            peak=url + " (HGX B200 per-GPU table, sparse figures halved); copy of the table: "
            "https://zdszero.github.io/Computer/Artificial_Intelligence/Hardware.html",
        ),
        notes="HGX B200 per-GPU figures (180 GB, 7.7 TB/s); the marketing figure for B200 is 192 GB / 8 TB/s.",
    )


# ---------------------------------------------------------------- AMD
@HARDWARE.register("mi300x")
def mi300x() -> HardwareSpec:
    url = "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"
    return HardwareSpec(
        id="mi300x",
        name="AMD Instinct MI300X",
        peak_flops={
            "fp32": 163.4 * T,
            "tf32": 653.7 * T,
            "bf16": 1307.4 * T,
            "fp16": 1307.4 * T,
            "fp8": 2614.9 * T,
            "int8": 2614.9 * T,
        },
        sparse_peak_flops={
            "tf32": 1307.4 * T,
            "bf16": 2614.9 * T,
            "fp16": 2614.9 * T,
            "fp8": 5229.8 * T,
            "int8": 5229.8 * T,
        },
        memory_bytes=192 * G,
        memory_bandwidth=5.3 * T,
        interconnect_bandwidth=896 * G,
        onchip_bytes=256 * M,
        sources=_sources(
            url,
            peak=url + "; cross-check https://raw.githubusercontent.com/alpharomercoma/MI300X-vs-H200/"
            "6077fdc7bfc215171c33435b7cd76ca4c5f2b236/METHODOLOGY.md",
            interconnect_bandwidth="https://gpu.blog/gpus/instinct-mi300x-mi300x (896 GB/s xGMI)",
            onchip_bytes="https://rocm.docs.amd.com/en/7.13.0-preview/reference/gpu-specs.html",
        ),
        notes="Interconnect: 7 Infinity Fabric links x 128 GB/s. On-chip: 256 MB Infinity Cache.",
    )


@HARDWARE.register("mi350x")
def mi350x() -> HardwareSpec:
    url = "https://www.amd.com/en/products/accelerators/instinct/mi350/mi350x.html"
    return HardwareSpec(
        id="mi350x",
        name="AMD Instinct MI350X",
        peak_flops={"fp32": 144.2 * T, "bf16": 2.3e15, "fp16": 2.3e15, "fp8": 4.6e15, "int8": 4.6e15, "fp4": 9.2e15},
        sparse_peak_flops={"bf16": 4.6e15, "fp16": 4.6e15, "fp8": 9.2e15, "int8": 9.2e15},
        memory_bytes=288 * G,
        memory_bandwidth=8 * T,
        interconnect_bandwidth=1075.2 * G,
        onchip_bytes=256 * M,
        sources=_sources(
            url,
            peak=url + "; fp16/fp8/fp4 cross-checked against the 8-GPU platform figures "
            "(18.5/37/74 PF) in https://www.kontronn.com/hardware/amd-unveils-new-instinct-mi350-ai-accelerator",
            onchip_bytes="https://rocm.docs.amd.com/en/7.13.0-preview/reference/gpu-specs.html",
        ),
        notes="No TF32 units (emulated via BF16). fp4 = MXFP4/MXFP6 rate. Interconnect: 7 links x 153.6 GB/s. "
        "fp32, int8 and interconnect figures are from the vendor page and were not cross-checked.",
    )


# ---------------------------------------------------------------- Google TPU
@HARDWARE.register("tpu-v6e")
def tpu_v6e() -> HardwareSpec:
    url = "https://cloud.google.com/tpu/docs/v6e"
    return HardwareSpec(
        id="tpu-v6e",
        name="Google TPU v6e (Trillium)",
        peak_flops={"bf16": 918 * T, "int8": 1836 * T},
        memory_bytes=32 * G,
        memory_bandwidth=1638 * G,
        interconnect_bandwidth=800 * G,
        sources=_sources(url, peak=url),
        notes="One TensorCore with two 256x256 MXUs per chip; 2D torus ICI.",
    )


@HARDWARE.register("tpu-v7")
def tpu_v7() -> HardwareSpec:
    url = "https://cloud.google.com/tpu/docs/tpu7x"
    wiki = "https://aiwiki.ai/wiki/tpu_ironwood"
    return HardwareSpec(
        id="tpu-v7",
        name="Google TPU7x (Ironwood)",
        peak_flops={"bf16": 2307 * T, "fp8": 4614 * T},
        memory_bytes=192 * G,
        memory_bandwidth=7.37 * T,
        interconnect_bandwidth=1200 * G,
        sources=_sources(
            url,
            peak=url,
            memory_bytes=url + " (192 GiB in the table; 192 GB in Google's launch post)",
            memory_bandwidth=wiki + " (7.37 TB/s per Google's launch; the Cloud docs table says 7380 GB/s)",
        ),
        notes="Two TensorCores and four SparseCores per chip; up to 9216 chips per pod.",
    )


# ---------------------------------------------------------------- Groq
@HARDWARE.register("groq-lpu")
def groq_lpu() -> HardwareSpec:
    news = "https://techpowerup.com/news-tags/Processor?page=3"
    sram = "https://ykim.synology.me/wordpress/?p=3943"
    c2c = "https://www.linleygroup.com/newsletters/newsletter_detail.php?num=6233"
    return HardwareSpec(
        id="groq-lpu",
        name="Groq LPU (GroqChip, TSP v1)",
        peak_flops={"fp16": 188 * T, "int8": 750 * T},
        memory_bytes=230 * M,
        memory_bandwidth=80 * T,
        interconnect_bandwidth=480 * G,
        onchip_bytes=230 * M,
        onchip_bandwidth=80 * T,
        sources=_sources(
            news,
            peak=news + " (750 TOPS INT8, 188 TFLOPS FP16; 80 TB/s; 230 MB SRAM)",
            memory_bytes=sram,
            memory_bandwidth=news,
            onchip_bytes=news,
            onchip_bandwidth=news,
            interconnect_bandwidth=c2c + " (16 chip-to-chip links, 480 GB/s total)",
        ),
        notes="No DRAM: the 230 MB SRAM is the only memory, so a model is split across "
        "chips_to_hold(weights + KV) chips; the all-reduce model ignores per-hop latency.",
    )


@HARDWARE.register("this-machine")
def this_machine_entry() -> HardwareSpec:
    from .measure import this_machine

    return this_machine(measure_if_missing=True)
