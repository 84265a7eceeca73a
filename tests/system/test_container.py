"""The container recipe's parts, tested on the host (no Docker engine runs here): the Dockerfile
copies every package folder pyproject maps and runs as a non-root user with a health check; the
entrypoint runs glibc malloc (the faster here) or preloads jemalloc with its MALLOC_CONF, binds to
a NUMA node, refuses bad settings, and by default serves the demo model on the port, where the
image's health check passes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "docker" / "entrypoint.sh"
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
JEMALLOC = Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")


def _entry(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ENTRY), *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_the_dockerfile_copies_every_package_and_runs_unprivileged():
    section = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-dir]")[1].split("\n[")[0]
    dirs = set(re.findall(r'^"[\w.]+" = "(\w+)"$', section, re.M))
    assert "parallel" in dirs and "mm_engine" in dirs
    copied = set(re.findall(r"^COPY (\S+) \1$", DOCKERFILE, re.M))
    assert dirs <= copied, f"not copied into the image: {sorted(dirs - copied)}"
    assert DOCKERFILE.count("USER mm") == 2 and "useradd" in DOCKERFILE  # both targets
    assert re.findall(r"^FROM .* AS (\w+)$", DOCKERFILE, re.M) == ["cpu", "gpu"]
    assert DOCKERFILE.count("HEALTHCHECK") == 2 and "/health" in DOCKERFILE
    assert 'ENTRYPOINT ["/opt/mm-engine/docker/entrypoint.sh"]' in DOCKERFILE


@pytest.mark.skipif(not JEMALLOC.exists(), reason="libjemalloc2 is not installed (.ci/run installs it)")
def test_the_entrypoint_preloads_jemalloc_unless_told_not_to():
    probe = "import os; print('jemalloc' in open('/proc/self/maps').read(), os.environ.get('MALLOC_CONF'))"
    loaded, conf = _entry("python", "-c", probe, MM_ENGINE_ALLOCATOR="jemalloc").stdout.split()
    assert loaded == "True" and "background_thread:true" in conf
    mine = _entry(
        "python", "-c", probe, MM_ENGINE_ALLOCATOR="jemalloc", MALLOC_CONF="narenas:1"
    ).stdout.split()
    assert mine == ["True", "narenas:1"]  # a MALLOC_CONF of one's own is kept
    assert _entry("python", "-c", probe, MM_ENGINE_ALLOCATOR="glibc").stdout.split()[0] == "False"
    env = {k: v for k, v in os.environ.items() if k != "MM_ENGINE_ALLOCATOR"}
    default = subprocess.run([str(ENTRY), "python", "-c", probe], env=env, capture_output=True, text=True)
    assert default.stdout.split()[0] == "False"  # glibc with the engine's tuning: it measured faster
    bad = _entry("true", MM_ENGINE_ALLOCATOR="tcmalloc")
    assert bad.returncode == 2 and "MM_ENGINE_ALLOCATOR" in bad.stderr


@pytest.mark.skipif(
    subprocess.run(["sh", "-c", "command -v numactl"], capture_output=True).returncode != 0,
    reason="numactl is not installed (.ci/run installs it)",
)
def test_the_entrypoint_binds_to_a_numa_node():
    node0 = subprocess.run(["numactl", "--hardware"], capture_output=True, text=True).stdout
    cpus = sorted(int(c) for c in re.search(r"node 0 cpus:([\d ]*)", node0).group(1).split())
    got = _entry("python", "-c", "import os; print(sorted(os.sched_getaffinity(0)))", MM_ENGINE_NUMA_NODE="0")
    assert got.stdout.strip() == str(cpus)
    assert _entry("true", MM_ENGINE_NUMA_NODE="zero").returncode == 2


def test_by_default_it_serves_the_demo_model_and_the_health_check_passes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(ENTRY), "--port", str(port), "--host", "127.0.0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "the server exited"
            time.sleep(0.5)
        else:
            pytest.fail("no /health within 120 s")
        check = re.search(r'CMD \["python", "-c", "(.*)"\]', DOCKERFILE).group(1).replace("8000", str(port))
        assert subprocess.run([sys.executable, "-c", check], timeout=30).returncode == 0
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
        assert models["data"][0]["id"] == "mm-engine-demo"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
