"""What this machine can run, and why: the capability decision table and ``onecard probe``.

Contract:
  ``decide(cc, dtype, quantization, kv_cache_dtype) -> Decision``: pure function of the compute capability
  (``(7, 0)`` for a V100, ``None`` for CPU), the serving dtype, the quantization method and the KV-cache dtype.
  ``Decision.allowed`` is False with ``refusal`` naming the cause when onecard cannot serve that combination;
  ``backends`` maps attention / dense_gemm / moe / sampling to the backend used on that card, with its reason.
  Rules: fp16 everywhere; bf16 needs sm80+; FP8 weights need sm89+ and onecard does not implement them
  (refused on every card); KV-cache dtypes as kv_dtype.hardware_problem says (fp8_e5m2 on every card,
  fp8 / fp8_e4m3 on sm89+); GPTQ runs fp16 on a GPU (bf16 refused, as in vLLM); sm < 7.0 refused.
  ``probe() -> ProbeReport`` inspects GPUs, driver, torch and Triton (never raises); ``main_probe(as_json)``
  prints it and returns 0, or 1 when a check failed (``failed_step`` names it). No GPU = CPU mode, exit 0.
  ``host_memory() -> HostMemory | None``: this machine's RAM (total, available now), the room for a host KV tier
  (``--kv-offloading-size``); the probe reports it and the runner refuses a tier larger than what is available.
"""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

from onecard import kv_dtype
from onecard.dtypes import DTYPE_ALIASES, normalize_dtype  # noqa: F401 - the dtype names' home; re-exported
from onecard.kernels import paths

logger = logging.getLogger(__name__)

MIN_CC = (7, 0)
GPTQ_NAMES = ("gptq", "gptq_marlin")
FP8_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2", "modelopt_fp8", "fbgemm_fp8")


@dataclass(slots=True)
class Decision:
    allowed: bool
    backends: dict[str, str] = field(default_factory=dict)   # op family -> "backend (reason)"
    reasons: list[str] = field(default_factory=list)
    refusal: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sm(cc: tuple[int, int] | None) -> str:
    return "CPU" if cc is None else f"sm{cc[0]}{cc[1]}"


def _backends(cc: tuple[int, int] | None, quantized: bool) -> dict[str, str]:
    return paths.describe(paths.as_int(cc), quantized)


def decide(cc: tuple[int, int] | None, dtype: str, quantization: str | None, kv_cache_dtype: str = "auto") -> Decision:
    """The capability decision table (see the module docstring). ``dtype`` is the resolved serving dtype."""
    where = sm(cc)
    quant = (quantization or "").lower() or None
    if quant == "auto":
        quant = None
    kv = str(kv_cache_dtype or "auto").lower()
    d = Decision(allowed=True, backends=_backends(cc, quant in GPTQ_NAMES))

    def refuse(msg: str) -> Decision:
        d.allowed, d.refusal = False, msg
        d.reasons.append(msg)
        return d

    if cc is not None and tuple(cc) < MIN_CC:
        return refuse(f"compute capability {cc[0]}.{cc[1]} ({where}) is below onecard's minimum 7.0 (Volta): "
                      "its Triton kernels need sm70+.")
    dt = normalize_dtype(dtype)
    if dt is None:
        return refuse(f"--dtype={dtype} is unknown; use float16, bfloat16 or float32.")
    if quant is not None and quant in FP8_NAMES:
        if cc is None or cc < (8, 9):
            return refuse(f"FP8 weights (--quantization={quant}) need compute capability 8.9+ (Ada/Hopper); "
                          f"this is {where}. Use a 4-bit GPTQ checkpoint.")
        return refuse(f"FP8 weights (--quantization={quant}) are not implemented by onecard yet; "
                      "use a 4-bit GPTQ checkpoint.")
    if quant is not None and quant not in GPTQ_NAMES:
        return refuse(f"--quantization={quant} is not supported; onecard runs 4-bit GPTQ (gptq).")
    try:
        kv_fmt = kv_dtype.resolve(kv, dt)
    except ValueError as e:
        return refuse(str(e))
    if dt == "bfloat16" and quant in GPTQ_NAMES:
        return refuse("--dtype=bfloat16 is not supported with GPTQ (as in vLLM): the w4a16 kernels compute in "
                      "float16; use --dtype=float16.")
    if cc is not None:
        if dt == "bfloat16" and not paths.bf16_allowed(paths.as_int(cc)):
            return refuse(f"--dtype=bfloat16 needs compute capability 8.0+ and this is {where}; use "
                          "--dtype=float16 (same memory; Qwen3 runs with fp32 accumulation and fp32 norms).")
        if dt == "float32" and quant in GPTQ_NAMES:
            return refuse("GPTQ on a GPU runs in float16 only (as in vLLM); use --dtype=float16.")
        kv_why = kv_dtype.hardware_problem(kv_fmt, (int(cc[0]), int(cc[1])))
        if kv_why:
            return refuse(kv_why)
        if quant == "gptq_marlin":
            d.reasons.append("gptq_marlin is served by onecard's own GPTQ kernels (no Marlin).")
    d.reasons.append(f"dtype {dt} allowed on {where}" + (" (bf16 needs sm80+, FP8 sm89+)" if cc else ""))
    if kv_dtype.is_fp8(kv_fmt):
        d.reasons.append(f"KV cache {kv_fmt}: 1 byte per element, half the bytes per token of fp16")
    if cc is not None and not paths.tensor_core_dot(paths.as_int(cc)):
        d.reasons.append("tl.dot has no tensor cores before sm80: large prefill GEMMs go through cuBLAS")
    return d


def allowed_dtypes(cc: tuple[int, int] | None) -> dict[str, str]:
    """Each dtype -> "allowed" or the reason it is not, for the probe's table."""
    out = {}
    for dt in ("float16", "bfloat16", "float32"):
        dec = decide(cc, dt, None, "auto")
        out[dt] = "allowed" if dec.allowed else str(dec.refusal)
    dec = decide(cc, "float16", "fp8", "auto")
    out["fp8"] = str(dec.refusal)
    for kv in kv_dtype.FP8_FORMATS:
        dec = decide(cc, "float16", None, kv)
        out[f"kv {kv}"] = "allowed" if dec.allowed else str(dec.refusal)
    return out


# ------------------------------------------------------------------ host memory (the host KV tier)
@dataclass(slots=True)
class HostMemory:
    total_bytes: int
    available_bytes: int            # MemAvailable: what can be allocated (and pinned) without swapping

    @property
    def available_gib(self) -> float:
        return self.available_bytes / 2**30


def host_memory(meminfo: str = "/proc/meminfo") -> HostMemory | None:
    """RAM of this machine from /proc/meminfo; None where it cannot be read (not Linux)."""
    try:
        with open(meminfo) as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.strip()}
        return HostMemory(fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", 0)))
    except (OSError, KeyError, ValueError, IndexError):
        return None


def host_tier_refusal(requested_bytes: int, mem: HostMemory | None) -> str | None:
    """Why a host KV tier of ``requested_bytes`` cannot be allocated here (None when it can, or is unknown)."""
    if mem is None or requested_bytes <= mem.available_bytes:
        return None
    return (f"--kv-offloading-size={requested_bytes / 2**30:g} GiB is more than this machine's available host "
            f"memory ({mem.available_gib:.1f} GiB of {mem.total_bytes / 2**30:.1f} GiB); use at most "
            f"{int(mem.available_gib)} (or free memory).")


# ------------------------------------------------------------------ probe
@dataclass(slots=True)
class GpuInfo:
    index: int
    name: str
    compute_capability: str           # "7.0"
    total_memory_gib: float
    free_memory_gib: float | None
    arch_covered: bool
    arch_reason: str
    decision: dict[str, Any] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Step:
    name: str
    status: str                       # "ok" | "skipped" | "warn" | "failed"
    detail: str


@dataclass(slots=True)
class ProbeReport:
    mode: str = "cpu"                 # "cuda" | "cpu"
    torch_version: str | None = None
    torch_cuda_runtime: str | None = None
    torch_arch_list: list[str] = field(default_factory=list)
    driver_version: str | None = None
    driver_cuda_version: str | None = None
    triton_version: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    cpu_backends: dict[str, str] = field(default_factory=dict)
    structured_outputs: str | None = None  # the grammar backend and its version ("xgrammar 0.2.9")
    host_memory_total_gib: float | None = None
    host_memory_available_gib: float | None = None      # room for a host KV tier (--kv-offloading-size)
    verdict: str = ""

    @property
    def failed_step(self) -> str | None:
        bad = [s for s in self.steps if s.status == "failed"]
        return f"{bad[0].name}: {bad[0].detail}" if bad else None

    @property
    def ok(self) -> bool:
        return self.failed_step is None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"], d["failed_step"] = self.ok, self.failed_step
        return d

    def render(self) -> str:
        lines = [f"mode: {self.mode}", (f"torch {self.torch_version} (CUDA runtime {self.torch_cuda_runtime}), "
                 f"arch list {' '.join(self.torch_arch_list) or '(empty)'}"),
                 f"driver {self.driver_version or '-'} (supports CUDA {self.driver_cuda_version or '-'})",
                 f"triton {self.triton_version or '-'}",
                 f"structured outputs: {self.structured_outputs or 'unavailable (xgrammar is not installed)'}"]
        for g in self.gpus:
            lines.append(f"GPU {g.index}: {g.name}  sm{g.compute_capability.replace('.', '')}  "
                         f"{g.total_memory_gib:.2f} GiB total, "
                         f"{'-' if g.free_memory_gib is None else f'{g.free_memory_gib:.2f}'} GiB free")
            lines.append(f"  torch kernels: {g.arch_reason}")
            for op, b in g.decision.get("backends", {}).items():
                lines.append(f"  {op:<11} {b}")
            for dt, why in g.dtypes.items():
                lines.append(f"  {dt:<9} {why}")
        if not self.gpus:
            lines.append("no GPU visible: CPU mode")
            for op, b in self.cpu_backends.items():
                lines.append(f"  {op:<11} {b}")
        if self.host_memory_available_gib is not None:
            lines.append(f"host memory: {self.host_memory_total_gib:.1f} GiB, {self.host_memory_available_gib:.1f} "
                         "GiB available for a host KV tier (--kv-offloading-size GiB, off by default)")
        lines.append("checks:")
        for s in self.steps:
            lines.append(f"  [{s.status:^7}] {s.name}: {s.detail}")
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def arch_covers(cc: tuple[int, int], arch_list: list[str]) -> tuple[bool, str]:
    """Does torch's arch list run on ``cc``? An sm_XY cubin runs on the same major with minor >= Y;
    compute_XY PTX is JIT-compiled for any cc >= XY."""
    want = cc[0] * 10 + cc[1]
    for a in arch_list:
        kind, _, num = a.partition("_")
        if not num.isdigit():
            continue
        n = int(num)
        if kind == "sm" and n // 10 == cc[0] and n <= want:
            return True, f"{a} in torch.cuda.get_arch_list() runs on sm{want}"
    for a in arch_list:
        kind, _, num = a.partition("_")
        if kind == "compute" and num.isdigit() and int(num) <= want:
            return True, f"{a} PTX in torch.cuda.get_arch_list() is JIT-compiled for sm{want}"
    return False, (f"torch built without sm_{want} kernels (arch list: {' '.join(arch_list) or 'empty'}); "
                   f"install a PyTorch build for this card (a V100 needs CUDA 12.x wheels, e.g. cu126)")


def _nvidia_smi() -> tuple[str | None, str | None, int]:
    """(driver version, driver's CUDA version, GPU count) from nvidia-smi; Nones when it is absent."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None, 0
    try:
        q = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10, check=False)
        rows = [r.strip() for r in q.stdout.splitlines() if r.strip()]
        full = subprocess.run([exe], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None, 0
    cuda = None
    if "CUDA Version:" in full:
        cuda = full.split("CUDA Version:")[1].split()[0].strip("|")
    return (rows[0] if rows else None), cuda, len(rows)


_TEST_N = 1000


def _triton_step(report: ProbeReport, device_index: int | None, cc: tuple[int, int] | None) -> Step:
    try:
        import triton
        import triton.language as tl
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        return Step("triton", "failed", f"cannot import triton: {e}")
    report.triton_version = triton.__version__

    @triton.jit
    def _probe_add(x, y, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out + offs, tl.load(x + offs, mask=m) * 2.0 + tl.load(y + offs, mask=m), mask=m)

    if device_index is None:
        # CPU mode: compile ahead of time for sm70 (the oldest supported card) to check the toolchain.
        try:
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource

            sig = {"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32", "BLOCK": "constexpr"}
            k = triton.compile(ASTSource(fn=_probe_add, signature=sig, constexprs={"BLOCK": 128}),
                               target=GPUTarget("cuda", 70, 32))
            ok = bool(k.asm.get("cubin"))
        except Exception as e:  # noqa: BLE001
            return Step("triton", "warn", f"CPU mode: ahead-of-time sm70 compile failed ({e}); run skipped")
        return Step("triton", "ok" if ok else "warn",
                    "CPU mode: test kernel compiled for sm70 ahead of time; run skipped (no GPU)")
    try:
        import torch

        dev = torch.device("cuda", device_index)
        x = torch.arange(_TEST_N, dtype=torch.float32, device=dev)
        y = torch.ones(_TEST_N, dtype=torch.float32, device=dev)
        out = torch.empty_like(x)
        _probe_add[(triton.cdiv(_TEST_N, 128),)](x, y, out, _TEST_N, BLOCK=128)
        torch.cuda.synchronize(dev)
        if not torch.equal(out, x * 2 + y):
            return Step("triton", "failed", f"test kernel ran on {sm(cc)} but returned wrong values")
    except Exception as e:  # noqa: BLE001
        return Step("triton", "failed", f"test kernel did not compile or run on {sm(cc)}: {e}")
    return Step("triton", "ok", f"test kernel compiled and ran on {sm(cc)} (results checked)")


def structured_outputs_backend() -> str | None:
    """The structured-outputs (grammar) backend and its version, e.g. "xgrammar 0.2.9"; None if absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"xgrammar {version('xgrammar')}"
    except PackageNotFoundError:
        return None


def probe() -> ProbeReport:
    """Inspect this machine. Never raises: every problem becomes a failed step."""
    r = ProbeReport()
    r.structured_outputs = structured_outputs_backend()
    mem = host_memory()
    if mem is not None:
        r.host_memory_total_gib, r.host_memory_available_gib = mem.total_bytes / 2**30, mem.available_gib
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        r.steps.append(Step("torch", "failed", f"cannot import torch: {e}"))
        r.verdict = "torch is not importable"
        return r
    r.torch_version, r.torch_cuda_runtime = torch.__version__, torch.version.cuda
    r.driver_version, r.driver_cuda_version, smi_count = _nvidia_smi()
    r.steps.append(Step("torch", "ok", f"torch {r.torch_version}, CUDA runtime {r.torch_cuda_runtime or 'none (CPU build)'}"))
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        init_error = None
        if count == 0 and (smi_count or r.torch_cuda_runtime):
            try:
                torch.cuda.init()
            except Exception as e:  # noqa: BLE001 - e.g. "Error 803: system has unsupported display driver"
                init_error = str(e)
    except Exception as e:  # noqa: BLE001
        count, init_error = 0, str(e)
    if count == 0:
        if smi_count and r.torch_cuda_runtime is None:
            r.steps.append(Step("cuda init", "failed", f"nvidia-smi sees {smi_count} GPU(s) but torch "
                                f"{r.torch_version} is a CPU-only build; install a CUDA build of PyTorch"))
        elif smi_count:
            hint = ""
            if r.driver_cuda_version and r.torch_cuda_runtime and \
                    _ver(r.driver_cuda_version) < _ver(r.torch_cuda_runtime):
                hint = (f"the driver {r.driver_version} supports CUDA {r.driver_cuda_version} but torch needs "
                        f"CUDA {r.torch_cuda_runtime}: the driver is too old for the CUDA runtime; ")
            r.steps.append(Step("cuda init", "failed", f"{hint}nvidia-smi sees {smi_count} GPU(s) but torch "
                                f"cannot use them: {init_error or 'torch.cuda.is_available() is False'}"))
        else:
            r.steps.append(Step("cuda init", "skipped", "no GPU visible: CPU mode"
                                + (f" ({init_error})" if init_error else "")))
        r.cpu_backends = _backends(None, True)
        r.steps.append(_triton_step(r, None, None))
        r.verdict = (f"FAILED at {r.failed_step}" if not r.ok else
                     "no GPU: CPU mode (reference PyTorch kernels; fine for tests, far too slow to serve the 30B model)")
        return r
    r.mode = "cuda"
    try:
        r.torch_arch_list = list(torch.cuda.get_arch_list())
    except Exception as e:  # noqa: BLE001
        r.steps.append(Step("arch list", "failed", f"torch.cuda.get_arch_list() failed: {e}"))
    r.steps.append(Step("cuda init", "ok", f"{count} GPU(s) visible to torch"))
    if r.driver_version is None:
        r.driver_version = _pynvml_driver()
    for i in range(count):
        try:
            p = torch.cuda.get_device_properties(i)
            real = paths.real_capability(i)
            cc = (real // 10, real % 10)                                 # the card's own (arch coverage, report)
            use = paths.capability(i)                                    # what every decision uses
            dcc = (use // 10, use % 10)
            try:
                free, total = torch.cuda.mem_get_info(i)
                free_gib: float | None = free / 2**30
            except Exception:  # noqa: BLE001
                free_gib, total = None, p.total_memory
        except Exception as e:  # noqa: BLE001
            r.steps.append(Step(f"GPU {i}", "failed", f"cannot read device properties: {e}"))
            continue
        covered, why = arch_covers(cc, r.torch_arch_list)
        if dcc != cc:
            r.steps.append(Step(f"GPU {i} emulation", "warn", f"ONECARD_EMULATE_CC: decisions take {sm(dcc)}'s "
                                f"branches on this {sm(cc)} card (Triton compiles for {sm(cc)})"))
        dec = decide(dcc, "float16", "gptq", "auto")
        g = GpuInfo(index=i, name=p.name, compute_capability=f"{cc[0]}.{cc[1]}", total_memory_gib=total / 2**30,
                    free_memory_gib=free_gib, arch_covered=covered, arch_reason=why, decision=dec.to_dict(),
                    dtypes=allowed_dtypes(dcc))
        r.gpus.append(g)
        if tuple(cc) < MIN_CC:
            r.steps.append(Step(f"GPU {i} capability", "failed", str(dec.refusal)))
        r.steps.append(Step(f"GPU {i} torch kernels", "ok" if covered else "failed", why))
    first = r.gpus[0] if r.gpus else None
    if first is not None and first.arch_covered:
        cc0 = tuple(int(x) for x in first.compute_capability.split("."))
        r.steps.append(_triton_step(r, first.index, cc0))  # type: ignore[arg-type]
    elif first is not None:
        r.steps.append(Step("triton", "skipped", "torch has no kernels for this card, so no test run"))
    if r.ok and first is not None:
        r.verdict = (f"ready: {first.name} (sm{first.compute_capability.replace('.', '')}, "
                     f"{first.total_memory_gib:.1f} GiB) serves 4-bit GPTQ in float16"
                     + ("; bf16 also allowed" if first.dtypes.get("bfloat16") == "allowed" else "; no bf16 (sm80+)"))
    else:
        r.verdict = f"FAILED at {r.failed_step}"
    return r


def _ver(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in v.split(".")[:2])
    except ValueError:
        return (0,)


def _pynvml_driver() -> str | None:
    try:
        import pynvml  # optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # noqa: BLE001
        return None


def main_probe(as_json: bool = False) -> int:
    """``onecard probe [--json]``: print the report; 0 when every check passed (CPU mode included), else 1."""
    report = probe()
    print(json.dumps(report.to_dict(), indent=2) if as_json else report.render())
    return 0 if report.ok else 1
