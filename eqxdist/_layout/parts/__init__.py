"""One module per parallelism of a layout (`Part`): the questions a step, an
evaluation step and a loader ask of a layout, each answered by the parts that
have something to say (see `base.Part` and the folder's README)."""
