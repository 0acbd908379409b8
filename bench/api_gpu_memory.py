"""Which processes hold GPU memory while `onecard serve` runs (issue 28 item 6), as nvidia-smi reports them.

Starts `onecard serve` (the bundled model, or MODEL and flags after `--`) on the GPU, waits for /health, sends
one request, then reads `nvidia-smi --query-compute-apps=pid,used_memory` and classifies every PID: the API
process (the one started here), the engine process (its descendants), or other. Writes OUT_JSON and exits 0
only when the API process holds no GPU memory (no CUDA context) and the engine does.
Usage: python bench/api_gpu_memory.py OUT_JSON [-- MODEL serve-flags...]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx


def descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    seen, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


def gpu_apps() -> list[dict]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True).stdout
    apps = []
    for line in out.strip().splitlines():
        pid, name, mem = (x.strip() for x in line.split(","))
        apps.append({"pid": int(pid), "name": name, "used_mib": int(mem)})
    return apps


def main() -> int:
    out_json = Path(sys.argv[1])
    extra = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    port = 18000 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "onecard.cli", "serve", *extra, "--host", "127.0.0.1", "--port", str(port)]
    log = out_json.with_suffix(".serve.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"onecard serve exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("onecard serve not healthy after 900 s")
            time.sleep(1)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "def f(x):", "max_tokens": 16},
                       timeout=120)
        r.raise_for_status()
        apps = gpu_apps()
        engine = descendants(proc.pid)
        for a in apps:
            a["role"] = "api" if a["pid"] == proc.pid else "engine" if a["pid"] in engine else "other"
        api_mib = sum(a["used_mib"] for a in apps if a["role"] == "api")
        engine_mib = sum(a["used_mib"] for a in apps if a["role"] == "engine")
        ok = api_mib == 0 and engine_mib > 0 and not any(a["role"] == "api" for a in apps)
        if not apps:            # a container's PID namespace can hide every process from nvidia-smi
            print("nvidia-smi lists no compute processes here (PID namespace?): cannot tell", file=sys.stderr)
            ok = None
        result = {"command": cmd, "api_pid": proc.pid, "engine_pids": sorted(engine), "apps": apps,
                  "api_used_mib": api_mib, "engine_used_mib": engine_mib, "only_engine_holds_gpu_memory": ok}
        out_json.write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        return 0 if ok else 2 if ok is None else 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
