"""What a run leaves on disk: checkpoints and their manifest, the ledger of
trained trajectories, the failures log, metrics sinks (jsonl, TensorBoard,
W&B, MLflow), plots and the model card. It imports only the config, types
and models."""
