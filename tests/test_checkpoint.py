"""Checkpoints: written atomically and durably; a file that is not a whole checkpoint of this model is refused."""

import json
import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import dsgd
from dsgd.driver import checkpoint
from dsgd.wire.partitions import VarSpec
from dsgd_test_models import AdamNet, TanhNet, assert_replicas_identical

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SAVE_LOOP_JOB = os.path.join(TESTS_DIR, "save_loop_job.py")
WEIGHT = VarSpec("w", (1000,), np.dtype(np.float32))
EXPECTED = {"weights": [WEIGHT], "optimizer": []}
WRITTEN_BY_SAVE = "written by DistributedSGD\\.save"


def small_state(step: int) -> dict:
    return {"weights": {"w": np.full(WEIGHT.shape, step, np.float32)}, "optimizer": {}, "applied_steps": step}


def test_round_trip_continues_exactly(ray_session, tmp_path):
    path = str(tmp_path / "run.ckpt")
    with dsgd.DistributedSGD(AdamNet, num_workers=2, strategy="ps", grad_shard_bytes=40) as sgd:
        for _ in range(2):
            sgd.step()
        sgd.save(path)
        for _ in range(2):
            sgd.step()
        uninterrupted = sgd.get_weights()

        sgd.set_weights({k: np.zeros_like(v) for k, v in uninterrupted.items()})
        sgd.restore(path)
        assert sgd.num_steps == 2
        sgd.foreach_model(lambda m: setattr(m, "step", 2))  # the data position is the user's
        for _ in range(2):
            sgd.step()
        restored = sgd.get_weights()
        assert_replicas_identical(sgd, 2)
    for name in uninterrupted:
        assert np.array_equal(restored[name], uninterrupted[name]), name


def test_save_fsyncs_the_file_renames_it_then_fsyncs_the_directory(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(source, target):
        events.append(("rename", os.fspath(source), os.fspath(target)))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    directory = os.path.realpath(tmp_path)
    path = os.path.join(directory, "run.ckpt")
    checkpoint.save(path, small_state(1))
    (_, written), (_, renamed, target), (_, synced) = events
    assert os.path.dirname(written) == directory
    assert re.fullmatch(r"\.run\.ckpt\.\w+\.tmp", os.path.basename(written))
    assert (renamed, target) == (written, path)
    assert synced == directory
    assert os.listdir(directory) == ["run.ckpt"]


def test_save_into_new_directories_makes_each_one_durable_in_its_parent(tmp_path, monkeypatch):
    synced = []
    fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    top = os.path.realpath(tmp_path)
    checkpoint.save(os.path.join(top, "runs", "trial_0") + os.sep, small_state(1))
    created = os.path.join(top, "runs", "trial_0")
    written = os.path.join(created, checkpoint.CHECKPOINT_FILE)
    assert synced[:2] == [top, os.path.join(top, "runs")]  # each new directory's entry, outermost first
    assert synced[3:] == [created] and synced[2].startswith(os.path.join(created, "."))  # then the save itself
    assert checkpoint.load(written, EXPECTED)["applied_steps"] == 1


def test_process_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL a process half-way through writing a 128 MiB checkpoint over an older one: the older one loads."""
    elements = 32 << 20
    path = tmp_path / "run.ckpt"
    proc = subprocess.Popen([sys.executable, SAVE_LOOP_JOB, str(path), str(elements)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = threading.Timer(120, proc.kill)  # bounds the reads below: a killed job's stdout ends
    deadline.start()
    try:
        # The job says when its second save has written half of its file, and waits there.
        lines = [proc.stdout.readline() for _ in range(2)]
        assert lines == ["SAVED 0\n", "HALF-WRITTEN 1\n"], (lines, proc.poll())
        proc.kill()
        _, err = proc.communicate(timeout=30)
    finally:
        deadline.cancel()
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    state = checkpoint.load(path, {"weights": [VarSpec("w", (elements,), np.dtype(np.float32))], "optimizer": []})
    assert state["applied_steps"] == 0
    assert np.all(state["weights"]["w"] == 0)
    left = [name for name in os.listdir(tmp_path) if name != "run.ckpt"]
    assert len(left) == 1 and re.fullmatch(r"\.run\.ckpt\.\w+\.tmp", left[0]), left  # it was killed mid-save
    assert elements * 4 // 2 <= (tmp_path / left[0]).stat().st_size < elements * 4
    other = tmp_path / ".run.ckpt.old.abcd1234.tmp"  # a temporary file of the checkpoint "run.ckpt.old"
    other.write_bytes(b"")
    checkpoint.save(path, small_state(1))  # the next save removes the killed save's file, only that
    assert sorted(os.listdir(tmp_path)) == [other.name, "run.ckpt"]


def test_failed_save_keeps_the_previous_checkpoint_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = str(tmp_path / "run.ckpt")
    checkpoint.save(path, small_state(1))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, small_state(2))
    assert os.listdir(tmp_path) == ["run.ckpt"]
    assert checkpoint.load(path, EXPECTED)["applied_steps"] == 1


def test_save_into_a_missing_directory_names_it(tmp_path):
    directory = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=f"cannot save the checkpoint .*run.ckpt: its directory "
                                                f"{re.escape(str(directory))} does not exist"):
        checkpoint.save(directory / "run.ckpt", small_state(1))


def truncate(path):
    checkpoint.save(path, small_state(1))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_a_byte_in_the_middle(path):
    checkpoint.save(path, small_state(1))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # in the weight's data: the small metadata entry comes first
    path.write_bytes(bytes(data))


def write_npz(path, **arrays):
    with open(path, "wb") as f:  # np.savez(path) would add ".npz" to the name
        np.savez(f, **arrays)


def metadata(format_version: int) -> np.ndarray:
    return np.array(json.dumps({"format": format_version, "applied_steps": 0}))


BAD_FILES = {
    "missing": (lambda path: None, FileNotFoundError, "no checkpoint at {path}: no such file"),
    "empty": (lambda path: path.write_bytes(b""), ValueError, "{path} is not a dsgd checkpoint: it is empty"),
    "random bytes": (lambda path: path.write_bytes(np.random.RandomState(0).bytes(4096)), ValueError,
                     "{path} is not a dsgd checkpoint: it is not an .npz \\(zip\\) file: it starts with b'"),
    "truncated": (truncate, ValueError,
                  "{path} is truncated: its \\d+ bytes end before the archive's index, as when a write"),
    "corrupt": (flip_a_byte_in_the_middle, ValueError,
                "{path} is corrupt \\(\\d+ bytes\\): BadZipFile: Bad CRC-32 for file 'weights/w.npy'"),
    "another .npz": (lambda path: write_npz(path, x=np.zeros(3)), ValueError,
                     "{path} is an .npz file but not a dsgd checkpoint: it has no '__meta__' entry "
                     "\\(it holds \\['x'\\]\\)"),
    "another format": (lambda path: write_npz(path, __meta__=metadata(2)), ValueError,
                       "{path} has the metadata '{{\"format\": 2, \"applied_steps\": 0}}'; expected format 1"),
    "a foreign entry": (lambda path: write_npz(path, __meta__=metadata(1), x=np.zeros(3)), ValueError,
                        "{path} holds the entry 'x', which is not a dsgd checkpoint's"),
}


@pytest.mark.parametrize("kind", BAD_FILES)
def test_a_file_that_is_not_a_whole_checkpoint_gets_an_error_naming_it_and_the_problem(tmp_path, kind):
    make, error, problem = BAD_FILES[kind]
    path = tmp_path / "run.ckpt"
    make(path)
    with pytest.raises(error, match=problem.format(path=re.escape(str(path))) + ".*" + WRITTEN_BY_SAVE):
        checkpoint.load(str(path), EXPECTED)


def test_a_checkpoint_whose_weight_has_another_dtype_is_refused_naming_both(tmp_path):
    path = tmp_path / "float64.ckpt"
    checkpoint.save(path, {"weights": {"w": np.zeros(WEIGHT.shape, np.float64)}, "optimizer": {}, "applied_steps": 1})
    with pytest.raises(ValueError, match=f"{re.escape(str(path))} was written by a different model: "
                                         "weights 'w' is float64\\[1000\\], the model has float32\\[1000\\]"):
        checkpoint.load(str(path), EXPECTED)


def test_a_directory_without_a_checkpoint_is_named_with_what_it_holds(tmp_path):
    np.save(tmp_path / "model.npy", np.zeros(3))  # what Ray 0.6's save_checkpoint wrote
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(tmp_path))} is not a checkpoint: it is a directory "
                                                "that holds no dsgd_checkpoint.npz \\(it holds \\['model.npy'\\]\\); "
                                                "expected"):
        checkpoint.load(str(tmp_path), EXPECTED)


def test_restore_refuses_a_bad_checkpoint_by_name_and_keeps_the_weights(ray_session, tmp_path):
    other_model = tmp_path / "other.ckpt"
    checkpoint.save(other_model, {"weights": {"layer/w": np.zeros((2, 2), np.float32), "conv/k": np.zeros(1)},
                                  "optimizer": {}, "applied_steps": 5})
    ray06_directory = tmp_path / "ray06"
    ray06_directory.mkdir()
    np.save(ray06_directory / "model.npy", np.zeros(3))
    with dsgd.DistributedSGD(TanhNet, num_workers=1) as sgd:
        sgd.step()
        own = tmp_path / "own.ckpt"
        sgd.save(own)
        with open(own, "r+b") as f:
            f.truncate(100)
        weights = sgd.get_weights()
        with pytest.raises(ValueError, match=f"{re.escape(str(other_model))} was written by a different model: "
                                             "missing weights 'layer/b'.*unexpected weights 'conv/k'.*"
                                             "'layer/w' is float32\\[2, 2\\], the model has float32\\[5, 4\\]"):
            sgd.restore(other_model)
        with pytest.raises(ValueError, match=f"{re.escape(str(own))} is truncated"):
            sgd.restore(own)
        with pytest.raises(FileNotFoundError, match=f"{re.escape(str(ray06_directory))} is not a checkpoint: it is "
                                                    "a directory"):
            sgd.restore_checkpoint(ray06_directory)
        after = sgd.get_weights()
        assert all(np.array_equal(after[k], weights[k]) for k in weights)
        assert sgd.num_steps == 1
