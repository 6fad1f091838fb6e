"""The training loop around the engine: set-up, train step, evaluation, logging (tensorboard),
checkpoints and exit signals. Uses ``megatron.engine`` and ``megatron.data``; reads no flags itself
(it is handed a ``RunConfig``)."""
