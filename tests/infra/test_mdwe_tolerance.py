"""Which of infra/systemd's units can have ``MemoryDenyWriteExecute=yes``: each process run under the
same seccomp filter systemd installs for it (tests/infra/mdwe_filter.py).

The API (``freight api``: gunicorn, an upload, a batch, a download, the console) and beat
(``freight beat`` sending its ticks) work under it, so their units set it. The control worker does
not: validating an audio line decodes it with ``soundfile``, whose in-memory reads are cffi
callbacks, and cffi needs memory that is writable and executable for them (refused: MemoryError).
The engine worker's unit leaves it off too: PyTorch's oneDNN kernels are generated at run time
(measured on an AVX-512 host: a bfloat16 ``linear`` failed with "could not create a primitive").
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from api.services.tenants import create_tenant
from storage.settings import Settings
from tests.api_process import api_env, api_process
from tests.conftest import REPO, now
from tests.factories import chat_line, jsonl
from tests.infra.test_systemd_units import UNITS, one, parse, values

UNDER_FILTER = [sys.executable, "-m", "tests.infra.mdwe_filter"]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*UNDER_FILTER, sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def test_the_filter_refuses_writable_executable_memory() -> None:
    done = run_python(
        "import ctypes, mmap\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.mmap.restype = ctypes.c_void_p\n"
        "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
        "rwx = mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC\n"
        "p = libc.mmap(None, 4096, rwx, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)\n"
        "print(p == ctypes.c_void_p(-1).value, ctypes.get_errno())\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "1"]  # MAP_FAILED, EPERM


@pytest.fixture
def api_under_filter(settings: Settings, tmp_path: Path) -> Iterator[str]:
    with api_process(
        api_env(settings), tmp_path, wrapper=UNDER_FILTER, what="freight api answering under the filter"
    ) as (base, _):
        yield base


def test_the_api_serves_under_memory_deny_write_execute(api_under_filter: str, runtime) -> None:
    key = create_tenant(runtime.db, "alpha", now())[1]
    client = OpenAI(base_url=api_under_filter + "/v1", api_key=key, max_retries=0)
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(20)]
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert client.files.content(uploaded.id).content == jsonl(lines)
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert client.batches.retrieve(batch.id).id == batch.id
    assert [f.id for f in client.files.list()] == [uploaded.id]
    assert httpx.get(api_under_filter + "/readyz", timeout=10).status_code == 200
    assert httpx.get(api_under_filter + "/console/", timeout=10, follow_redirects=True).status_code == 200


def test_beat_ticks_under_memory_deny_write_execute(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "beat.log"
    env = {**api_env(settings), "FREIGHT_TICK_SECONDS": "1"}
    with log.open("wb") as out:
        beat = subprocess.Popen(
            [*UNDER_FILTER, sys.executable, "-m", "api.cli", "beat"],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while log.read_text().count("Sending due task freight-tick") < 3 and time.monotonic() < deadline:
            assert beat.poll() is None, log.read_text()[-2000:]
            time.sleep(0.5)
        assert log.read_text().count("Sending due task freight-tick") >= 3, log.read_text()[-2000:]
    finally:
        beat.send_signal(signal.SIGTERM)
        beat.wait(30)


AUDIO_IN_MEMORY = (
    "import io, numpy as np, soundfile\n"
    "b = io.BytesIO()\n"
    "soundfile.write(b, np.zeros(1600, dtype='float32'), 16000, format='WAV')\n"
    "print(len(soundfile.read(io.BytesIO(b.getvalue()))[0]))\n"
)


def test_audio_decoding_of_the_control_worker_fails_under_it() -> None:
    """Why freight-control.service leaves it off: workers/audio.py reads a clip from memory."""
    plain = subprocess.run(
        [sys.executable, "-c", AUDIO_IN_MEMORY], capture_output=True, text=True, timeout=120
    )
    assert plain.returncode == 0 and plain.stdout.strip() == "1600", plain.stderr  # fine without it
    done = run_python(AUDIO_IN_MEMORY)
    assert done.returncode != 0
    assert "Cannot allocate write+execute memory for ffi.callback()" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("freight-api.service", ["yes"]),
        ("freight-beat.service", ["yes"]),
        ("freight-control.service", []),
        ("freight-worker@.service", []),
    ],
)
def test_the_units_set_it_where_it_was_tolerated(name: str, expected: list[str]) -> None:
    unit = parse(UNITS / name)
    assert values(unit, "Service", "MemoryDenyWriteExecute") == expected
    assert one(unit, "Service", "User") == "freight"
