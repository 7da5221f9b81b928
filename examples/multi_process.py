"""Train the UvA tutorial's classifier on several processes, with checkpoints.

Run it as 2 processes with 4 CPU devices each (the same 8 devices, now across
processes), or plainly as one process with 8 devices; the results agree:

    python -m eqxdist.launch --num-processes 2 --devices-per-process 4 \\
        examples/multi_process.py --checkpoint-dir /tmp/ckpt
    python examples/multi_process.py --checkpoint-dir /tmp/ckpt2

The data is a fixed, learnable set (inputs labelled by a simple rule), so the
accuracy rises over the steps; step `i` uses a fixed block of it, so a resumed run
sees the same batches as an uninterrupted one. Every process builds the same global
batch and feeds the step its own rows.
A `CheckpointManager` saves every `--checkpoint-every` steps and the last in the
background and keeps the newest `--keep`; started again with the same
`--checkpoint-dir`, the run resumes from the latest complete one. SIGTERM to any
process (or to the launcher), as a cluster scheduler sends on preemption, makes
every process stop at the same step, save it and exit with status 0; the next run
resumes from exactly there.
`--crash-at STEP` makes the last process raise at that step on the first attempt
(`EQXDIST_RESTART_COUNT` 0): the launcher stops the run at once, and with
`--max-restarts 1` it restarts the job, which resumes from the latest checkpoint and
runs past that step:

    python -m eqxdist.launch -n 2 -d 4 --max-restarts 1 examples/multi_process.py \\
        --checkpoint-dir /tmp/ckpt3 --crash-at 15
"""

import argparse
import os
from pathlib import Path

import _tutorial
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqxdist as ed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _tutorial.add_tutorial_arguments(parser)
    parser.add_argument(
        "--strategy",
        choices=["dp", "fsdp"],
        default="fsdp",
        help="data parallel or fully sharded parameters",
    )
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="save checkpoints here and resume from the latest one",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=5, help="save every this many steps"
    )
    parser.add_argument(
        "--log-every", type=int, default=10, help="print mean metrics every N steps"
    )
    parser.add_argument(
        "--num-examples",
        type=int,
        default=2048,
        help="size of the fixed training set the batches cycle through",
    )
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument(
        "--crash-at",
        type=int,
        help="raise in the last process at this step, on the launcher's first "
        "attempt only (EQXDIST_RESTART_COUNT 0), so that a restart gets past it",
    )
    # More steps and a higher learning rate than the tutorial's timing run, so the
    # accuracy visibly rises on the learnable data.
    parser.set_defaults(steps=30, lr=3e-3)
    return parser.parse_args()


ARGS = parse_args()
# Plain `python examples/multi_process.py`: 8 simulated devices. Under the launcher
# `XLA_FLAGS` already gives each process its `--devices-per-process`, which wins.
ed.simulate_cpu_devices(8)
ed.initialize_distributed()  # before anything starts JAX's backend


def local_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's block of rows of the global batch."""
    n, p = jax.process_count(), jax.process_index()
    return {k: np.asarray(v).reshape(n, -1, *v.shape[1:])[p] for k, v in batch.items()}


def learnable_data(key: jax.Array, num_examples: int) -> dict[str, np.ndarray]:
    """Standard-normal inputs labelled by which of their first 10 features is the
    largest: unlike fresh random labels every step, a rule the classifier learns."""
    inputs = jax.random.normal(key, (num_examples, _tutorial.INPUT_SIZE))
    labels = jnp.argmax(inputs[:, : _tutorial.NUM_CLASSES], axis=1)
    return {"inputs": np.asarray(inputs), "labels": np.asarray(labels, np.int32)}


def batch_at(data: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """Step `i`'s global batch: the next `--batch-size` rows, cycling."""
    n = len(data["labels"])
    rows = (np.arange(ARGS.batch_size) + i * ARGS.batch_size) % n
    return {k: v[rows] for k, v in data.items()}


def main() -> None:
    mesh = ed.create_data_parallel_mesh()  # every device of every process
    if jax.process_index() == 0:
        info = ed.get_mesh_info(mesh)
        print(
            f"{info['process_count']} process(es) x {info['local_devices']} devices; "
            f"strategy {ARGS.strategy}"
        )
    optimizer = optax.adamw(ARGS.lr)
    step = ed.make_train_step(
        _tutorial.loss_fn,
        optimizer,
        mesh,
        strategy=ARGS.strategy,
        num_minibatches=ARGS.minibatches,
        min_weight_size=ARGS.min_weight_size,
    )
    model_key, state_key, data_key = jax.random.split(jax.random.key(ARGS.seed), 3)
    data = learnable_data(data_key, ARGS.num_examples)
    state = step.place_state(
        ed.TrainState.create(_tutorial.Classifier(model_key), optimizer, state_key)
    )

    if ARGS.checkpoint_dir is None:
        train(step, state, 0, None, data)
        return
    with ed.CheckpointManager(
        ARGS.checkpoint_dir,
        max_to_keep=ARGS.keep,
        save_interval_steps=ARGS.checkpoint_every,
        async_save=True,
    ) as manager:
        start = manager.latest_step() or 0
        if start:
            # The fresh state is the target: its structure and its shardings.
            state = manager.restore(state)
            if jax.process_index() == 0:
                print(f"resumed from step {start}")
        train(step, state, start, manager, data)


def train(
    step: ed.TrainStep,
    state: ed.TrainState,
    start: int,
    manager: ed.CheckpointManager | None,
    data: dict[str, np.ndarray],
) -> None:
    """Steps `start..--steps-1`; prints the mean metrics of every `--log-every`
    steps (accuracy rises), saves through `manager` and stops when preempted."""
    totals: dict[str, tuple[float, float]] = {}
    first = start
    # The launcher counts its restarts; a crash on every attempt would show none.
    first_attempt = os.environ.get("EQXDIST_RESTART_COUNT", "0") == "0"
    crashes = first_attempt and jax.process_index() == jax.process_count() - 1
    for i in range(start, ARGS.steps):
        if i == ARGS.crash_at and crashes:
            raise RuntimeError(f"--crash-at {i}: process {jax.process_index()} fails")
        state, metrics = step(state, local_rows(batch_at(data, i)))
        for name, (total, count) in metrics.items():
            old_total, old_count = totals.get(name, (0.0, 0.0))
            totals[name] = (old_total + float(total), old_count + float(count))
        preempted = False
        if manager is not None:
            # Saves every --checkpoint-every steps, the last step, and at once
            # when preempted.
            manager.save(i + 1, state, force=i + 1 == ARGS.steps)
            preempted = manager.reached_preemption(i + 1)
        if preempted or (i + 1) % ARGS.log_every == 0 or i + 1 == ARGS.steps:
            ed.print_metrics(totals, f"Steps {first}-{i}")
            totals, first = {}, i + 1
        if preempted:
            if jax.process_index() == 0:
                print(f"preempted: saved step {i + 1}; run again to resume")
            break


if __name__ == "__main__":
    main()
