"""Disk tier: round trips through direct I/O, capacity, file lifecycle, buffered fallback, and run-dir management."""
import errno
import os

import pytest
import torch

from flexh2o.storage import disk as disk_mod
from flexh2o.storage.base import TierFullError
from flexh2o.storage.disk import ALIGN, DiskTier
from flexh2o.storage.offload_dir import MARKER, free_disk_bytes, make_run_dir, remove_run_dir


def _values(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-2**40, 2**40, shape, generator=g, dtype=dtype)


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(str(tmp_path / "run"), capacity=1 << 26)
    yield t
    t.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", [(3, 5, 7), (1,), (2, 3, 1000, 3), (4096,), ()])
def test_round_trip(tier, dtype, shape):
    x = _values(shape, dtype)
    h = tier.alloc(shape, dtype)
    assert os.path.getsize(h.path) % ALIGN == 0 and os.path.getsize(h.path) >= h.nbytes
    tier.store(h, x)
    y = tier.load(h, torch.device("cpu"))
    assert y.dtype == dtype and y.shape == x.shape and torch.equal(y, x)
    assert tier.bytes_loaded == tier.bytes_stored == x.numel() * x.element_size()


def test_load_converts_dtype_and_restore_overwrites(tier):
    h = tier.alloc((2, 3, 17, 5), torch.float16)
    tier.store(h, _values(h.shape, torch.float16, seed=1))
    new = _values(h.shape, torch.float16, seed=2)
    tier.store(h, new, slots=torch.zeros(2, 3, dtype=torch.long))  # slots are ignored: whole tensor written
    assert torch.equal(tier.load(h, "cpu"), new)
    y32 = tier.load(h, "cpu", torch.float32)
    assert y32.dtype == torch.float32 and torch.equal(y32, new.float())


def test_is_direct_on_work_filesystem(tier):
    assert tier.is_direct  # /tmp and /work are ext4 here; this pins that the real O_DIRECT path is exercised


def test_capacity_enforced(tmp_path):
    t = DiskTier(str(tmp_path / "run"), capacity=1000)
    h = t.alloc((100,), torch.float32)  # 400 bytes (padding is not counted)
    t.alloc((100,), torch.float32)
    with pytest.raises(TierFullError):
        t.alloc((100,), torch.float32)
    assert t.used == 800 and len(os.listdir(t.directory)) == 2
    t.free(h)
    t.free(h)  # idempotent
    assert t.used == 400
    t.alloc((100,), torch.float32)
    t.close()


def test_free_and_close_remove_files(tmp_path):
    run = make_run_dir(str(tmp_path))
    t = DiskTier(run, capacity=1 << 20)
    a, b = t.alloc((10,), torch.int64), t.alloc((3, 3), torch.float16)
    t.free(a)
    assert not os.path.exists(a.path) and os.path.exists(b.path)
    t.close()
    assert not os.path.exists(run) and os.listdir(tmp_path) == []
    t.close()  # idempotent
    assert t.used == 0


def test_chunked_write_equals_whole_write(tier, monkeypatch):
    monkeypatch.setattr(disk_mod, "STAGE_BYTES", 3 * ALIGN)  # force several staging flushes plus a padded tail
    x = _values((37, 1001), torch.float32)
    whole, pieces = tier.alloc(x.shape, x.dtype), tier.alloc(x.shape, x.dtype)
    tier.store(whole, x)
    tier.write_from(pieces, (x[i:i + 5] for i in range(0, 37, 5)))
    assert torch.equal(tier.load(pieces, "cpu"), x)
    with open(whole.path, "rb") as f1, open(pieces.path, "rb") as f2:
        assert f1.read() == f2.read()
    with pytest.raises(ValueError):
        tier.write_from(pieces, [x[:3]])  # too few bytes


def test_fallback_when_o_direct_refused(tmp_path, monkeypatch, capsys):
    real_open = os.open

    def refuse_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_direct)
    t = DiskTier(str(tmp_path / "run"), capacity=1 << 20)
    assert not t.is_direct
    x = _values((3, 333), torch.bfloat16)
    h = t.alloc(x.shape, x.dtype)
    t.store(h, x)
    t.store(h, x * 2)
    assert torch.equal(t.load(h, "cpu"), x * 2)
    err = capsys.readouterr().err
    assert err.count("does not support direct I/O") == 1 and str(tmp_path / "run") in err
    t.close()
    assert not os.path.exists(t.directory)


def test_stale_run_dirs_removed_live_kept(tmp_path, capsys):
    dead = tmp_path / "flexh2o-run-999999999-x"
    dead.mkdir()
    (dead / "owner.pid").write_text("999999999\n")
    (dead / "t000000.bin").write_bytes(b"0" * 10)
    corrupt = tmp_path / "flexh2o-run-999999998-y"
    corrupt.mkdir()
    (corrupt / "owner.pid").write_text("garbage")
    alive = tmp_path / f"flexh2o-run-{os.getpid()}-z"
    alive.mkdir()
    (alive / "owner.pid").write_text(f"{os.getpid()}\n")
    for d in (dead, corrupt, alive):  # each made by flexh2o (only marked dirs are ever deleted)
        (d / MARKER[0]).write_text(MARKER[1])
    other = tmp_path / "not-ours"
    other.mkdir()
    run = make_run_dir(str(tmp_path))
    assert not dead.exists() and not corrupt.exists() and alive.exists() and other.exists()
    assert os.path.basename(run).startswith(f"flexh2o-run-{os.getpid()}-")
    assert open(os.path.join(run, "owner.pid")).read().split()[0] == str(os.getpid())
    err = capsys.readouterr().err
    assert f"removed stale offload directory {dead} left by a killed run" in err
    assert str(alive) not in err
    remove_run_dir(run)
    remove_run_dir(run)  # idempotent
    assert not os.path.exists(run)
    with pytest.raises(ValueError):
        remove_run_dir(str(other))


def test_unwritable_offload_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    bad = str(blocker / "offload")
    with pytest.raises(ValueError, match="--offload-dir .*a-file/offload is not writable.*pass a writable directory"):
        make_run_dir(bad)


def test_free_disk_bytes(tmp_path):
    assert free_disk_bytes(str(tmp_path)) > 0
    assert free_disk_bytes(str(tmp_path / "not" / "yet")) == free_disk_bytes(str(tmp_path))
