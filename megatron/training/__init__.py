"""The training loop around the engine: set-up, train step, evaluation, logging (tensorboard) and
exit signals. Uses ``megatron.engine``, ``megatron.checkpoint`` (saves and resumes) and
``megatron.data``; reads no flags itself (it is handed a ``RunConfig``)."""
