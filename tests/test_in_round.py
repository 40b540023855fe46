"""The in-round resume state in the blob store: a one-process state pushed and pulled whole; a
sharded state uploaded rank by rank and published by rank 0, pulled whole into every rank's own
directory; saves that crash part-way (some ranks uploaded, nothing published) never change what a
resume reads."""

from __future__ import annotations

import random
from pathlib import Path

from prodrl_pipelines.loop import in_round
from prodrl_pipelines.storage.blobstore import LocalBlobStore


def _write(d: Path, files: dict[str, bytes]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (d / name).write_bytes(data)


def _read(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def _rank_parts(save: int, world: int) -> list[dict[str, bytes]]:
    """What each rank of a sharded save writes on its own disk (rank 0 also the checkpoint's metadata)."""
    return [{f"__{r}_0.distcp": f"shard {r} of save {save}".encode(), f"meta-rank{r}.pt": f"meta {r}/{save}".encode(),
             **({".metadata": f"plan of save {save}".encode()} if r == 0 else {})} for r in range(world)]


def test_a_one_process_state_is_pushed_and_pulled_whole(tmp_path):
    blobs = LocalBlobStore(tmp_path / "store")
    f = tmp_path / "a" / "round-000001-rank0.pt"
    f.parent.mkdir()
    f.write_bytes(b"v1")
    in_round.push(blobs, f)
    f.write_bytes(b"v2")
    in_round.push(blobs, f)
    assert not in_round.pull(blobs, f)  # the local copy is as new as the store's
    g = tmp_path / "b" / f.name  # another machine
    assert in_round.pull(blobs, g) and g.read_bytes() == b"v2"
    assert len([k for k in blobs.list("in-round/") if not k.endswith("latest.json")]) == 1  # v1's upload is gone
    in_round.drop(blobs, f.name)
    assert blobs.list("in-round/") == [] and not in_round.pull(blobs, tmp_path / "c" / f.name)


def test_sharded_saves_that_crash_part_way_never_change_what_a_resume_reads(tmp_path):
    """Random saves of a 3-rank state, each crashing (or not) after some ranks uploaded their part: a
    resume on fresh disks always reads the last save every rank uploaded and rank 0 published, whole."""
    rng = random.Random(7)
    blobs, world, name = LocalBlobStore(tmp_path / "store"), 3, "round-000002-fsdp3"
    published = None
    for save in range(40):
        parts = _rank_parts(save, world)
        upload = in_round.new_upload()
        uploaded = rng.randint(0, world)  # ranks that got their part up before the crash (all: none)
        names = []
        for r in range(uploaded):
            d = tmp_path / f"node{r}" / f"save{save}" / f"rank{r}"
            _write(d, parts[r])
            names += in_round.upload_part(blobs, d, name, upload)
        if uploaded == world and rng.random() < 0.8:  # rank 0 may still die before publishing
            in_round.publish(blobs, name, upload, names, is_dir=True)
            published = {k: v for p in parts for k, v in p.items()}
        for r in range(world):  # every rank of the resume, each on a disk of its own with a stale part
            mine = tmp_path / f"resume{save}" / f"rank{r}"
            _write(mine, {"stale": b"from an older save"})
            assert in_round.pull(blobs, mine, name, whole=True) == (published is not None)
            assert (_read(mine) if mine.exists() else None) == published
        uploads = {k.split("/")[2] for k in blobs.list(f"in-round/{name}/") if not k.endswith("latest.json")}
        if uploaded == world and published == {k: v for p in parts for k, v in p.items()}:
            assert uploads == {upload}  # a publish deletes the previous state and crashed saves' parts
    in_round.drop(blobs, name)
    assert blobs.list("in-round/") == []
    assert not in_round.pull(blobs, tmp_path / "after" / "rank0", name, whole=True)
