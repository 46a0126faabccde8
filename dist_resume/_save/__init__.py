"""Layer 6: writing one checkpoint: a file (save), in the background (async_save), a sharded folder from FSDP2 (sharded),
one file gathered from FSDP2 shards (full_state)."""
