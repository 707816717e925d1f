"""benchmarks/disk_limit.py, the disk's own limit that bench_vllm_tiers.py sets each tier against: the file it
times is the blocks it says, written as kvcopy's store writes its data file (O_DIRECT where the block is
aligned), by fio where it is installed and by its own writer and reader otherwise; bad input is refused before
anything is written. Never how fast the disk was."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
from pathlib import Path

import pytest

from kvcopy.storage.files import DATA, direct_io_fits

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def disk_limit():
    spec = importlib.util.spec_from_file_location("disk_limit", ROOT / "benchmarks" / "disk_limit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def blocks_of(path: str, block_bytes: int) -> list[bytes]:
    data = Path(path).read_bytes()
    return [data[i : i + block_bytes] for i in range(0, len(data), block_bytes)]


def takes_o_direct(folder: Path) -> bool:
    """Whether the filesystem under ``folder`` opens a file with O_DIRECT (tmpfs refuses)."""
    probe = folder / "probe"
    probe.touch()
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


@pytest.mark.parametrize("block_bytes", [8192, 1000])  # aligned (O_DIRECT where the filesystem takes it), not
def test_the_plain_writer_writes_every_block_and_both_passes_give_a_rate(tmp_path, disk_limit, block_bytes):
    limit = disk_limit.SequentialFile(str(tmp_path / "limit"), block_bytes, 16, "python")
    try:
        assert limit.tool == "python" and limit.note == ""
        assert limit.direct == (direct_io_fits(block_bytes) and takes_o_direct(tmp_path))
        blocks = blocks_of(limit.path, block_bytes)
        # written through once: 16 blocks, each the same random block (one buffer, written at every offset)
        assert len(blocks) == 16 and set(blocks) == {blocks[0]} and blocks[0] != bytes(block_bytes)
        for rate in (limit.write_gbps(), limit.read_gbps()):
            assert math.isfinite(rate) and rate > 0
        assert blocks_of(limit.path, block_bytes) == blocks  # a pass overwrites the same bytes in place
    finally:
        limit.close()
    assert os.path.basename(limit.path) == DATA  # the store's data file's name: opened as the store opens it


def test_auto_without_fio_on_path_times_the_passes_itself(tmp_path, disk_limit, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-fio"))
    limit = disk_limit.SequentialFile(str(tmp_path / "limit"), 4096, 4)
    try:
        assert limit.tool == "python"
        assert math.isfinite(limit.read_gbps()) and limit.read_gbps() > 0
    finally:
        limit.close()
    with pytest.raises(FileNotFoundError, match="tool: 'fio' asked for"):
        disk_limit.SequentialFile(str(tmp_path / "fio"), 4096, 4, "fio")
    assert not (tmp_path / "fio").exists()


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (the bench times the disk itself)")
def test_fio_times_the_passes_where_it_is_installed(tmp_path, disk_limit):
    limit = disk_limit.SequentialFile(str(tmp_path / "limit"), 8192, 512, "fio")
    try:
        assert limit.tool == "fio"
        blocks = blocks_of(limit.path, 8192)
        assert len(blocks) == 512  # fio wrote the whole file through
        for rate in (limit.write_gbps(), limit.read_gbps()):
            assert math.isfinite(rate) and rate > 0
    finally:
        limit.close()


@pytest.mark.parametrize(
    ("args", "error", "named"),
    [
        ((8192.0, 4, "python"), TypeError, "block_bytes: expected an int, got float"),
        ((8192, True, "python"), TypeError, "blocks: expected an int, got bool"),
        ((0, 4, "python"), ValueError, "block_bytes: expected at least 1, got 0"),
        ((8192, -1, "python"), ValueError, "blocks: expected at least 1, got -1"),
        ((8192, 4, "dd"), ValueError, "tool: expected one of"),
    ],
)
def test_bad_input_is_refused_by_name_before_anything_is_written(tmp_path, disk_limit, args, error, named):
    with pytest.raises(error, match=named):
        disk_limit.SequentialFile(str(tmp_path / "limit"), *args)
    assert not (tmp_path / "limit").exists()
