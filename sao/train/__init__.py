"""The trainer step (actor and critic), its split across trainer groups,
sharding (FSDP2), sharded checkpoints and precision. It imports algo, models
and types."""
