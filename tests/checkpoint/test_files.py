"""The on-disk format: a damaged commit marker or a damaged checkpoint without
checksums is a `ValueError` naming the step, whatever the damage."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import v0_1_checkpoint

import eqxdist as ed

MARKER = "eqxdist_checkpoint.json"


def state():
    return {"w": jnp.arange(4096.0), "key": jax.random.key(1)}


def first_checksum(marker):
    return next(iter(marker["checksums"]))


def garble_checksum(marker):
    marker["checksums"][first_checksum(marker)][1] = "zz"


def number_as_checksum(marker):
    marker["checksums"][first_checksum(marker)] = 5


def key_leaf(marker):
    return next(e for e in marker["leaves"] if "prng_impl" in e)


# Each damage leaves the marker valid JSON.
DAMAGE = {
    "null": lambda m: None,
    "a list": lambda m: [m],
    "numbers as leaves": lambda m: dict(m, leaves=[1, 2]),
    "a string as a shape": lambda m: dict(
        m, leaves=[dict(e, shape="4096") for e in m["leaves"]]
    ),
    "checksums not a mapping": lambda m: dict(m, checksums=[1, 2]),
    "one checksum garbled": lambda m: garble_checksum(m) or m,
    "a number as a checksum": lambda m: number_as_checksum(m) or m,
    "a garbled prng_impl": lambda m: key_leaf(m).update(prng_impl="thre3fry") or m,
    "a number as prng_impl": lambda m: key_leaf(m).update(prng_impl=3) or m,
    "a string as version": lambda m: dict(m, version="2"),
}


def as_version_2(marker):
    """The marker as eqxdist 0.2 wrote it: no metadata, no digest of itself."""
    marker = {k: v for k, v in marker.items() if k not in ("metadata", "marker_sha256")}
    return dict(marker, version=2)


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_marker_that_is_still_json_names_the_step(tmp_path, damage, version):
    location = ed.save_checkpoint(tmp_path, state(), step=7)
    marker = json.loads((location / MARKER).read_text())
    if version == 2:
        marker = as_version_2(marker)
    (location / MARKER).write_text(json.dumps(DAMAGE[damage](marker)))
    with pytest.raises(ValueError, match=r"step 7 .* corrupted") as error:
        ed.restore_checkpoint(tmp_path, state())
    assert type(error.value) is ValueError


def test_a_version_2_marker_still_restores(tmp_path):
    location = ed.save_checkpoint(tmp_path, state(), step=7)
    marker = as_version_2(json.loads((location / MARKER).read_text()))
    (location / MARKER).write_text(json.dumps(marker))
    restored = ed.restore_checkpoint(tmp_path, state())
    np.testing.assert_array_equal(restored["w"], np.arange(4096.0))
    np.testing.assert_array_equal(
        jax.random.key_data(restored["key"]), jax.random.key_data(jax.random.key(1))
    )
    with ed.CheckpointManager(tmp_path) as manager:
        assert manager.metadata() == {}


@pytest.mark.parametrize("version", [2, 3])
def test_a_marker_that_lost_its_checksums_does_not_skip_verification(tmp_path, version):
    location = ed.save_checkpoint(tmp_path, state(), step=7)
    marker = json.loads((location / MARKER).read_text())
    if version == 2:
        marker = as_version_2(marker)
    del marker["checksums"]
    (location / MARKER).write_text(json.dumps(marker))
    victim = max((location / "default").rglob("*"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"step 7 .* corrupted.*checksums"):
        ed.restore_checkpoint(tmp_path, state())


@pytest.mark.parametrize("victim", ["_METADATA", "manifest.ocdbt"])
def test_a_deleted_orbax_file_without_a_checksum_names_the_step(tmp_path, victim):
    # v0.1 checkpoints have no checksums: Orbax's own error must still name the step.
    v0_1_checkpoint(tmp_path)
    (tmp_path / "3" / victim).unlink()
    with pytest.raises(ValueError, match=r"step 3 .* corrupted: it cannot be read"):
        ed.restore_checkpoint(tmp_path, {"w": np.zeros(4)})
