"""BatchLoader: global batches as a pure function of (seed, step) on any mesh,
read-ahead, errors, resuming, sources (memmap, indexable objects, Grain), checked
against NumPy indexing of the same data."""

import threading
import time

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from harness import loss_fn
from jax.sharding import PartitionSpec as P
from reference import train_one_device

import eqxdist as ed

ROWS = 50
DATA = {
    "x": np.arange(ROWS * 3, dtype=np.float32).reshape(ROWS, 3),
    "y": np.arange(ROWS, dtype=np.int32) % 7,
}


def expected_rows(step, batch_size, seed=0, shuffle=True, size=ROWS):
    """The contract, in NumPy: rows of epoch `step // spe`'s permutation of
    `range(size)` drawn from `(seed, epoch)`, wrapping around for a partial batch."""
    per_epoch = size // batch_size
    epoch, index = divmod(step, per_epoch)
    order = (
        np.random.default_rng([seed, epoch]).permutation(size)
        if shuffle
        else np.arange(size)
    )
    return order[np.arange(index * batch_size, (index + 1) * batch_size) % size]


def host(batch):
    return jax.tree.map(np.asarray, batch)


def meshes():
    devices = jax.devices()
    return {
        "1": (ed.create_data_parallel_mesh(1), "data"),
        "4": (ed.create_device_mesh({"data": 4}, devices=devices[:4]), "data"),
        "8": (ed.create_data_parallel_mesh(), "data"),
        "replica x data": (
            ed.create_device_mesh({"replica": 2, "data": 4}),
            ("replica", "data"),
        ),
        "data x model": (ed.create_device_mesh({"data": 4, "model": 2}), "data"),
        # What `jax.make_mesh` builds by default.
        "explicit replica x data": (
            ed.create_device_mesh({"replica": 2, "data": 4}, axis_types="explicit"),
            ("replica", "data"),
        ),
    }


class Recording:
    """An indexable source that records every `indices` it is asked for."""

    def __init__(self, data, delay=0.0, fail_at_call=None):
        self.data, self.delay, self.fail_at_call = data, delay, fail_at_call
        self.calls = []

    def __len__(self):
        return len(self.data["y"])

    def __getitem__(self, indices):
        if self.fail_at_call == len(self.calls):
            raise OSError("disk on fire")
        self.calls.append(np.array(indices))
        time.sleep(self.delay)
        return {k: v[indices] for k, v in self.data.items()}


@pytest.mark.parametrize("name", list(meshes()))
def test_same_global_batches_on_every_mesh(name):
    mesh, data_axis = meshes()[name]
    loader = ed.BatchLoader(DATA, 8, mesh, data_axis=data_axis, seed=3)
    assert loader.steps_per_epoch == ROWS // 8
    for step in [0, 1, 5, 6, 7, 13]:  # across two epoch boundaries
        batch = loader.batch(step)
        rows = expected_rows(step, 8, seed=3)
        np.testing.assert_array_equal(loader.indices(step), rows)
        for key in DATA:
            np.testing.assert_array_equal(np.asarray(batch[key]), DATA[key][rows])
            assert batch[key].sharding.spec == P(data_axis)
            assert batch[key].sharding.mesh == mesh
        # Rows in mesh order: each device holds its block of the global batch.
        for shard in batch["x"].addressable_shards:
            np.testing.assert_array_equal(
                np.asarray(shard.data), DATA["x"][rows][shard.index]
            )


def test_seeds_and_epochs_give_different_orders_and_shuffle_false_reads_in_order(
    mesh8,
):
    a = ed.BatchLoader(DATA, 8, mesh8, seed=0)
    b = ed.BatchLoader(DATA, 8, mesh8, seed=1)
    assert not np.array_equal(a.indices(0), b.indices(0))
    assert not np.array_equal(a.indices(0), a.indices(a.steps_per_epoch))
    plain = ed.BatchLoader(DATA, 8, mesh8, shuffle=False)
    for step in range(8):
        np.testing.assert_array_equal(
            plain.indices(step), np.arange(8) + 8 * (step % 6)
        )
        np.testing.assert_array_equal(
            np.asarray(plain.batch(step)["y"]), DATA["y"][plain.indices(step)]
        )


def test_drop_remainder_false_fills_the_last_batch_from_the_epochs_start(mesh8):
    loader = ed.BatchLoader(DATA, 16, mesh8, seed=2, drop_remainder=False)
    assert loader.steps_per_epoch == 4  # 50 rows: 3 full batches and 2 rows
    for epoch in range(2):
        order = np.random.default_rng([2, epoch]).permutation(ROWS)
        seen = np.concatenate([loader.indices(4 * epoch + i) for i in range(4)])
        np.testing.assert_array_equal(seen, np.concatenate([order, order[:14]]))
    # A batch larger than the data set wraps around it as often as needed.
    small = ed.BatchLoader(DATA, 120, mesh8, shuffle=False, drop_remainder=False)
    assert small.steps_per_epoch == 1
    np.testing.assert_array_equal(small.indices(3), np.arange(120) % ROWS)
    np.testing.assert_array_equal(
        np.asarray(small.batch(3)["x"]), DATA["x"][np.arange(120) % ROWS]
    )


def test_one_process_reads_all_rows_of_a_step_in_one_call(mesh8):
    source = Recording(DATA)
    loader = ed.BatchLoader(source, 16, mesh8, seed=5)
    for step in range(4):
        loader.batch(step)
    assert len(source.calls) == 4
    for step, call in enumerate(source.calls):
        np.testing.assert_array_equal(call, expected_rows(step, 16, seed=5))


def test_iterate_continues_the_batch_stream_across_epochs(mesh8):
    with ed.BatchLoader(DATA, 8, mesh8, seed=1, prefetch=3) as loader:
        reference = [host(loader.batch(step)) for step in range(7, 20)]
        for prefetch_stream in (loader.iterate(7),):
            got = []
            for step, batch in prefetch_stream:
                got.append((step, host(batch)))
                if step == 19:
                    break
    unthreaded = ed.BatchLoader(DATA, 8, mesh8, seed=1, prefetch=0).iterate(7)
    direct = [next(unthreaded) for _ in range(13)]
    assert [s for s, _ in got] == list(range(7, 20))
    assert [s for s, _ in direct] == list(range(7, 20))
    for (_, batch), (_, plain), want in zip(got, direct, reference, strict=True):
        for key in DATA:
            np.testing.assert_array_equal(batch[key], want[key])
            np.testing.assert_array_equal(np.asarray(plain[key]), want[key])


def test_read_ahead_reads_while_the_consumer_works_and_stays_bounded(mesh8):
    # While the consumer holds step k, the read of step k + 1 starts (without
    # read-ahead it would only start when the consumer asks: the wait below would
    # time out), and never more than `prefetch` steps are read ahead.
    source = Recording(DATA)
    loader = ed.BatchLoader(source, 8, mesh8, prefetch=2)
    with loader:
        for step, _ in loader.iterate():
            deadline = time.monotonic() + 60
            while len(source.calls) < step + 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # the consumer's "step"
            assert step + 2 <= len(source.calls) <= step + 3, (step, source.calls)
            if step == 9:
                break


def _calls_reach(source: Recording, count: int, timeout: float = 30.0) -> None:
    """Waits until the loader's thread has read `count` batches (a loaded machine
    only delays it), then a little longer for any read beyond them."""
    deadline = time.monotonic() + timeout
    while len(source.calls) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)


def test_read_ahead_is_bounded_by_prefetch(mesh8):
    source = Recording(DATA)
    with ed.BatchLoader(source, 8, mesh8, prefetch=2) as loader:
        stream = loader.iterate(0)
        next(stream)
        # Step 0 taken, then at most 2 batches ahead: steps 1 and 2.
        _calls_reach(source, 3)
        assert len(source.calls) == 3
        next(stream)
        _calls_reach(source, 4)
        assert len(source.calls) == 4


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_exception_in_the_source_surfaces_in_the_consumer_naming_the_step(
    mesh8, prefetch
):
    before = set(threading.enumerate())
    source = Recording(DATA, fail_at_call=3)
    with ed.BatchLoader(source, 8, mesh8, prefetch=prefetch) as loader:
        taken = []
        with pytest.raises(OSError, match="disk on fire") as info:
            for step, _ in loader.iterate(10):
                taken.append(step)
        assert taken == [10, 11, 12]
        assert "BatchLoader: raised reading the rows of step 13." in (
            info.value.__notes__
        )
    assert set(threading.enumerate()) == before


def test_a_source_returning_the_wrong_rows_is_named_in_the_consumer(mesh8):
    class Short(Recording):
        def __getitem__(self, indices):
            return {k: v[indices[:-1]] for k, v in self.data.items()}

    loader = ed.BatchLoader(Short(DATA), 8, mesh8)
    with pytest.raises(ValueError, match=r"shape \(7, 3\) at leaf \['x'\].*step 4"):
        loader.batch(4)
    with loader, pytest.raises(ValueError, match="step 2"):
        next(loader.iterate(2))


def test_no_thread_is_left_after_close(mesh8):
    before = set(threading.enumerate())
    loader = ed.BatchLoader(DATA, 8, mesh8)
    streams = [loader.iterate(0), loader.iterate(5)]
    next(streams[0])
    assert len(set(threading.enumerate()) - before) == 2
    loader.close()
    assert set(threading.enumerate()) == before
    assert list(streams[0]) == []  # ends without blocking
    assert next(streams[1], None) is None
    # Breaking out of a loop and closing the iterator stops its thread too.
    stream = loader.iterate(0)
    next(stream)
    stream.close()
    assert set(threading.enumerate()) == before


def test_resuming_from_step_5_is_bit_identical_to_10_steps(mesh8):
    rng = np.random.default_rng(0)
    data = {
        "x": rng.normal(size=(40, 3)).astype(np.float32),
        "y": rng.integers(0, 7, 40).astype(np.int32),
    }
    optimizer = optax.adam(1e-2)
    model = eqx.nn.MLP(3, 7, 16, 1, key=jax.random.key(0))
    train_step = ed.make_train_step(loss_fn, optimizer, mesh8)
    initial = ed.TrainState.create(model, optimizer, jax.random.key(1))

    def train(state, start, stop):
        with ed.BatchLoader(data, 16, mesh8, seed=4) as loader:
            for step, batch in loader.iterate(start):
                if step == stop:
                    return state
                state, _ = train_step(state, batch)

    straight = train(train_step.place_state(initial), 0, 10)
    half = train(train_step.place_state(initial), 0, 5)
    assert int(half.step) == 5
    resumed = train(half, int(half.step), 10)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        if eqx.is_array(a) and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # The same 10 steps on one device over NumPy-indexed batches.
    batches = [
        {k: v[expected_rows(step, 16, seed=4, size=40)] for k, v in data.items()}
        for step in range(10)
    ]
    reference = train_one_device(model, batches, optimizer, loss_fn).model
    for a, b in zip(
        jax.tree.leaves(eqx.filter(straight.model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(reference, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_memmap_source(tmp_path, mesh8):
    path = tmp_path / "tokens.bin"
    tokens = np.arange(64 * 5, dtype=np.uint16).reshape(64, 5)
    tokens.tofile(path)
    memmap = np.memmap(path, dtype=np.uint16, mode="r", shape=(64, 5))
    loader = ed.BatchLoader(memmap, 16, mesh8, seed=9)
    assert loader.steps_per_epoch == 4
    for step in [0, 3, 4]:
        batch = loader.batch(step)
        assert batch.dtype == np.uint16
        np.testing.assert_array_equal(
            np.asarray(batch), tokens[expected_rows(step, 16, seed=9, size=64)]
        )


def test_grain_map_dataset_is_a_source(mesh8):
    grain = pytest.importorskip("grain")
    dataset = grain.MapDataset.source(list(range(ROWS))).map(
        lambda i: {"x": DATA["x"][i], "y": DATA["y"][i]}
    )
    loader = ed.BatchLoader(dataset, 8, mesh8, seed=7)
    for step in [0, 6, 7]:
        batch = loader.batch(step)
        rows = expected_rows(step, 8, seed=7)
        for key in DATA:
            np.testing.assert_array_equal(np.asarray(batch[key]), DATA[key][rows])
    filtered = dataset.filter(lambda e: e["y"] != 0)
    loader = ed.BatchLoader(filtered, 8, mesh8, shuffle=False)
    with pytest.raises(ValueError, match="(?s)no element at index 0 .*step 0"):
        loader.batch(0)


@pytest.mark.parametrize(
    "source, kwargs, error, match",
    [
        ({"x": np.ones((5, 2)), "y": np.ones(4)}, {}, ValueError, "unequal leading"),
        ({"x": np.ones((5, 2)), "s": np.float32(1)}, {}, ValueError, r"\['s'\] is 0-d"),
        ({"x": np.ones((5, 2)), "t": "tag"}, {}, TypeError, r"\['t'\] is a str"),
        ({}, {}, ValueError, "no array leaves"),
        (np.ones((0, 2)), {"global_batch_size": 8}, ValueError, "is empty"),
        (DATA, {"global_batch_size": 12}, ValueError, "=12 must be a positive mult"),
        (DATA, {"global_batch_size": 0}, ValueError, "=0 must be a positive mult"),
        (DATA, {"global_batch_size": 56}, ValueError, r"larger than the data set \(50"),
        (DATA, {"seed": -1}, ValueError, "`seed` must be >= 0; got -1"),
        (DATA, {"prefetch": -1}, ValueError, "`prefetch` must be >= 0; got -1"),
        (DATA, {"data_axis": "model"}, ValueError, "'model' is not an axis"),
        (object(), {}, TypeError, "neither a pytree of arrays nor"),
        (DATA, {"global_batch_size": 8.0}, TypeError, "global_batch_size"),
    ],
)
def test_bad_arguments_are_named(mesh8, source, kwargs, error, match):
    kwargs = {"global_batch_size": 8, **kwargs}
    with pytest.raises(error, match=match):
        ed.BatchLoader(source, mesh=mesh8, **kwargs)


def test_negative_steps_are_rejected(mesh8):
    before = set(threading.enumerate())
    loader = ed.BatchLoader(DATA, 8, mesh8)
    for method in (loader.batch, loader.indices, loader.iterate):
        with pytest.raises(ValueError, match=r"\.\w+: `step` must be >= 0; got -1"):
            method(-1)
    with pytest.raises(TypeError, match="step"):
        loader.batch(1.0)
    assert set(threading.enumerate()) == before  # no reader started
