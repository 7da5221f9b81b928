"""Train the UvA tutorial's classifier on several processes, with checkpoints.

Run it as 2 processes with 4 CPU devices each (the same 8 devices, now across
processes), or plainly as one process with 8 devices; the results agree:

    python -m eqxdist.launch --num-processes 2 --devices-per-process 4 \\
        examples/multi_process.py --checkpoint-dir /tmp/ckpt
    python examples/multi_process.py --checkpoint-dir /tmp/ckpt2

Every process builds the same global batch and feeds `shard_batch` its own rows.
A `CheckpointManager` saves every `--checkpoint-every` steps in the background and
keeps the newest `--keep`; started again with the same `--checkpoint-dir`, the run
resumes from the latest complete one. SIGTERM to any process (or to the launcher),
as a cluster scheduler sends on preemption, makes every process stop at the same
step, save it and exit with status 0; the next run resumes from exactly there.
`--crash-at STEP` makes process 1 (or the only process) raise at that step: the
launcher stops the run at once, and the next run resumes where the last checkpoint
left off.
"""

import argparse
from pathlib import Path

import _tutorial
import jax
import numpy as np
import optax

import eqxdist as ed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _tutorial.add_tutorial_arguments(parser)
    parser.add_argument("--strategy", choices=["dp", "fsdp"], default="fsdp")
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="save here; resume from here (default: none)",
    )
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument(
        "--crash-at", type=int, help="raise in the last process at this step"
    )
    return parser.parse_args()


ARGS = parse_args()
# Plain `python examples/multi_process.py`: 8 simulated devices. Under the launcher
# `XLA_FLAGS` already gives each process its `--devices-per-process`, which wins.
ed.simulate_cpu_devices(8)
ed.initialize_distributed()  # before anything starts JAX's backend


def local_rows(batch: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """This process's block of rows of the global batch."""
    n, p = jax.process_count(), jax.process_index()
    return {k: np.asarray(v).reshape(n, -1, *v.shape[1:])[p] for k, v in batch.items()}


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
    state = step.place_state(
        ed.TrainState.create(_tutorial.Classifier(model_key), optimizer, state_key)
    )

    if ARGS.checkpoint_dir is None:
        train(step, state, 0, None, data_key)
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
        train(step, state, start, manager, data_key)


def train(
    step: ed.TrainStep,
    state: ed.TrainState,
    start: int,
    manager: ed.CheckpointManager | None,
    data_key: jax.Array,
) -> None:
    totals: dict[str, tuple[float, float]] = {}
    end = ARGS.steps
    for i in range(start, ARGS.steps):
        if i == ARGS.crash_at and jax.process_index() == jax.process_count() - 1:
            raise RuntimeError(f"--crash-at {i}: process {jax.process_index()} fails")
        batch = _tutorial.make_batch(jax.random.fold_in(data_key, i), ARGS.batch_size)
        state, metrics = step(state, local_rows(batch))
        for name, (total, count) in metrics.items():
            old_total, old_count = totals.get(name, (0.0, 0.0))
            totals[name] = (old_total + float(total), old_count + float(count))
        if manager is None:
            continue
        # Saves every --checkpoint-every steps, and at once when preempted.
        manager.save(i + 1, state)
        if manager.reached_preemption(i + 1):
            end = i + 1
            if jax.process_index() == 0:
                print(f"preempted: saved step {end}; run again to resume")
            break
    ed.print_metrics(totals, f"Steps {start}-{end - 1}")


if __name__ == "__main__":
    main()
